use super::*;
use crate::mask::{HeadScope, Mask, Slice, SliceKind};

fn set() -> MaskSet {
    MaskSet {
        pattern: "test".into(),
        seqlen: 48,
        params: Default::default(),
        documents: vec![],
        scope: HeadScope::Shared,
        masks: vec![Mask::new(
            48,
            48,
            vec![
                Slice::new([0, 30], [0, 30], SliceKind::Causal),
                Slice::new([30, 48], [10, 48], SliceKind::Full),
            ],
        )
        .unwrap()],
    }
}

fn cell(set: &MaskSet, direction: Direction) -> Cell<'_> {
    Cell {
        set,
        shape: Shape {
            heads_q: 4,
            heads_kv: 2,
            seqlen: 48,
            head_dim: 8,
            head_dim_v: None,
        },
        element: Element::Bf16,
        direction,
        seed: 3,
    }
}

fn record(cell: &Cell<'_>) -> Measurement {
    let harness = Harness {
        warmup_reps: 1,
        warmup_s: 0.0,
        min_reps: 3,
        max_reps: 5,
        ..Harness::default()
    };
    Measurement::for_kernel(
        "test",
        ("test", "0"),
        cell.set,
        cell.shape,
        cell.element,
        cell.direction,
        harness,
    )
}

/// The protocol on `cell` with the default harness and options.
fn measure(kernel: &mut Reference<'_>, cell: &Cell<'_>) -> Result<Measurement, PluginError> {
    run(
        kernel,
        cell,
        &Harness::default(),
        record(cell),
        Options::default(),
    )
}

/// The f64 reference as a kernel, or a wrong one (every output zero); counts its calls.
struct Reference<'a> {
    set: &'a MaskSet,
    wrong: bool,
    refuse_when_prepared: bool,
    oom_when_prepared: bool,
    /// Refuses the cell as a library does on its first call, or as a worker asked before the inputs.
    refuse_first_call: bool,
    refuse_in_budget: bool,
    /// Gives no LSE, as some libraries' APIs do; checks sampled rows when set.
    no_lse: bool,
    sampled: Option<usize>,
    fail: bool,
    needs: Option<u64>,
    run: Option<(Shape, HeadMasks<'a>, Inputs)>,
    forward: Option<Forward>,
    grads: Option<Grads>,
    calls: (usize, usize),
}

impl<'a> Reference<'a> {
    fn on(set: &'a MaskSet) -> Self {
        Reference {
            set,
            wrong: false,
            refuse_when_prepared: false,
            oom_when_prepared: false,
            refuse_first_call: false,
            refuse_in_budget: false,
            no_lse: false,
            sampled: None,
            fail: false,
            needs: None,
            run: None,
            forward: None,
            grads: None,
            calls: (0, 0),
        }
    }
}

impl<'a> KernelBench for Reference<'a> {
    fn budget(&mut self, _cell: &Cell<'_>) -> Result<Option<Budget>, PluginError> {
        if self.refuse_in_budget {
            return Err(PluginError::Unsupported(
                "the worker has no such kernel".into(),
            ));
        }
        Ok(self.needs.map(|needed| Budget {
            needed,
            free: 1 << 30,
            place: "on the device",
        }))
    }

    fn prepare(
        &mut self,
        cell: &Cell<'_>,
        inputs: &Inputs,
        record: &mut Measurement,
    ) -> Result<Prepared, PluginError> {
        if self.oom_when_prepared {
            return Err(PluginError::OutOfMemory(
                "the upload found 1 GiB short".into(),
            ));
        }
        if self.refuse_when_prepared {
            return Ok(Prepared::Unsupported("found out while preparing".into()));
        }
        record.details.insert("prepared".into(), true.into());
        self.run = Some((
            cell.shape,
            HeadMasks::new(self.set, &cell.shape),
            inputs.clone(),
        ));
        Ok(Prepared::Ready)
    }

    fn forward(&mut self) -> Result<(), PluginError> {
        if self.fail {
            return Err(PluginError::failed("kernel fault"));
        }
        if self.refuse_first_call {
            return Err(PluginError::Unsupported("No available kernel".into()));
        }
        let (shape, masks, inputs) = self.run.as_ref().unwrap();
        let mut forward = reference::forward(shape, masks, inputs);
        if self.wrong {
            forward.out.iter_mut().for_each(|x| *x = 0.0);
        }
        self.forward = Some(forward);
        self.calls.0 += 1;
        Ok(())
    }

    fn backward(&mut self) -> Result<(), PluginError> {
        let (shape, masks, inputs) = self.run.as_ref().unwrap();
        self.grads = Some(reference::backward(
            shape,
            masks,
            inputs,
            self.forward.as_ref().unwrap(),
        ));
        self.calls.1 += 1;
        Ok(())
    }

    fn outputs(&mut self, backward: bool) -> Result<(Forward, Option<Grads>), PluginError> {
        let mut forward = self.forward.clone().unwrap();
        if self.no_lse {
            forward.lse.clear();
        }
        Ok((forward, backward.then(|| self.grads.clone().unwrap())))
    }

    fn check_mode(&self, _cell: &Cell<'_>) -> CheckMode {
        self.sampled
            .map_or(CheckMode::Full, |rows| CheckMode::Sampled { rows })
    }

    fn memory(&mut self, _cell: &Cell<'_>) -> Option<Memory> {
        Some(Memory {
            peak_bytes: 2,
            above_inputs_bytes: 1,
            method: "counted".into(),
        })
    }
}

#[test]
fn a_right_kernel_is_checked_timed_and_recorded_with_its_phases() {
    let set = set();
    for direction in Direction::ALL.iter().copied() {
        let cell = cell(&set, direction);
        let mut kernel = Reference::on(&set);
        let m = run(
            &mut kernel,
            &cell,
            &record(&cell).harness.clone(),
            record(&cell),
            Options::default(),
        )
        .unwrap();
        assert_eq!(m.status, MeasureStatus::Ok, "{direction}");
        assert!(
            m.correctness.as_ref().unwrap().passed,
            "{direction}: {:?}",
            m.correctness
        );
        let timing = m.timing.as_ref().unwrap();
        assert!(timing.samples.len() >= 3, "{timing:?}");
        assert!(m.tflops.is_some() && m.time_s.is_some() && m.memory.is_some());
        assert_eq!(m.details["prepared"], true);
        for phase in [
            "inputs_s",
            "prepare_s",
            "first_run_s",
            "check_s",
            "timing_s",
        ] {
            assert!(
                m.phases[phase].as_f64().is_some(),
                "{phase} in {:?}",
                m.phases
            );
        }
        // The backward alone is timed on the first forward's outputs: no forward per repetition.
        match direction {
            Direction::Bwd => assert_eq!(kernel.calls.0, 1),
            _ => assert!(kernel.calls.0 > 3, "{:?}", kernel.calls),
        }
    }
}

#[test]
fn a_wrong_kernel_is_timed_with_its_check_failed() {
    let set = set();
    let cell = cell(&set, Direction::Fwd);
    let mut kernel = Reference {
        wrong: true,
        ..Reference::on(&set)
    };
    let m = measure(&mut kernel, &cell).unwrap();
    assert_eq!(m.status, MeasureStatus::Ok);
    assert!(!m.correctness.unwrap().passed);
    assert!(m.timing.is_some());
}

#[test]
fn a_cell_past_the_budget_is_oom_and_one_refused_while_preparing_is_unsupported() {
    let set = set();
    let cell = cell(&set, Direction::Fwd);
    let mut big = Reference {
        needs: Some(3 << 30),
        ..Reference::on(&set)
    };
    let m = measure(&mut big, &cell).unwrap();
    assert_eq!(m.status, MeasureStatus::Oom);
    assert_eq!(
        m.reason.as_deref(),
        Some("needs 3.0 GiB on the device, 1.0 GiB are free")
    );
    assert_eq!(big.calls, (0, 0));
    let mut refusing = Reference {
        refuse_when_prepared: true,
        ..Reference::on(&set)
    };
    let m = measure(&mut refusing, &cell).unwrap();
    assert_eq!(m.status, MeasureStatus::Unsupported);
    assert_eq!(m.reason.as_deref(), Some("found out while preparing"));
    assert!(m.timing.is_none() && m.correctness.is_none());
}

#[test]
fn running_out_of_memory_in_a_step_is_an_oom_record_and_other_errors_fail() {
    let set = set();
    let cell = cell(&set, Direction::Fwd);
    let mut short = Reference {
        oom_when_prepared: true,
        ..Reference::on(&set)
    };
    let m = measure(&mut short, &cell).unwrap();
    assert_eq!(m.status, MeasureStatus::Oom);
    assert_eq!(m.reason.as_deref(), Some("the upload found 1 GiB short"));
    let mut failing = Reference {
        fail: true,
        ..Reference::on(&set)
    };
    let error = measure(&mut failing, &cell).unwrap_err();
    assert_eq!(error.to_string(), "kernel fault");
}

#[test]
fn a_refusal_before_the_inputs_or_on_the_first_call_is_an_unsupported_record() {
    let set = set();
    let cell = cell(&set, Direction::FwdBwd);
    let mut asked = Reference {
        refuse_in_budget: true,
        ..Reference::on(&set)
    };
    let m = measure(&mut asked, &cell).unwrap();
    assert_eq!(m.status, MeasureStatus::Unsupported);
    assert_eq!(m.reason.as_deref(), Some("the worker has no such kernel"));
    assert!(asked.run.is_none(), "nothing prepared");
    let mut refusing = Reference {
        refuse_first_call: true,
        ..Reference::on(&set)
    };
    let m = measure(&mut refusing, &cell).unwrap();
    assert_eq!(m.status, MeasureStatus::Unsupported);
    assert_eq!(m.reason.as_deref(), Some("No available kernel"));
    assert!(m.timing.is_none() && m.correctness.is_none());
}

#[test]
fn a_kernel_without_an_lse_is_checked_on_its_other_outputs_and_the_record_says_so() {
    let set = set();
    let cell = cell(&set, Direction::FwdBwd);
    for sampled in [None, Some(5)] {
        let mut kernel = Reference {
            no_lse: true,
            sampled,
            ..Reference::on(&set)
        };
        let correctness = measure(&mut kernel, &cell).unwrap().correctness.unwrap();
        assert!(correctness.passed, "{correctness:?}");
        assert!(!correctness.errors.contains_key("lse"), "{correctness:?}");
        assert!(correctness.errors.contains_key("dq"), "{correctness:?}");
        assert!(
            correctness.checked.starts_with("O, dQ")
                && correctness
                    .checked
                    .ends_with("no LSE (the kernel gives none)"),
            "{}",
            correctness.checked
        );
    }
}
