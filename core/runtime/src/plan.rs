//! Matrix expansion: a validated pipeline becomes a list of nodes in dependency order.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::Arc;

use attnbench_sdk::{format_size, ParamType};
use serde_json::{Map, Value};

use crate::diagnostic::{Diagnostic, Origin};
use crate::pipeline::{presets, Pipeline, PipelineError, Stage, MAX_NODES};

/// A node's parameters: its stage's sorted parameters, shared by all its nodes, with the node's
/// own matrix values in place. A full map per node was 4 KB for a stage of two dozen parameters.
#[derive(Debug, Clone)]
pub struct Params {
    template: Arc<Map<String, Value>>,
    own: Vec<(Arc<str>, Value)>,
}

impl Params {
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self.own.iter().find(|(k, _)| &**k == key) {
            Some((_, value)) => Some(value),
            None => self.template.get(key),
        }
    }

    /// Keys in sorted order, with the node's values.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Value)> {
        self.template.iter().map(|(key, value)| {
            (
                key,
                self.own
                    .iter()
                    .find(|(k, _)| **k == **key)
                    .map_or(value, |(_, v)| v),
            )
        })
    }

    pub fn to_map(&self) -> Map<String, Value> {
        self.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

impl serde::Serialize for Params {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

/// A node's matrix coordinates: (axis, value) pairs.
type Coords = Vec<(String, String)>;

/// One unit of work: a stage with one assignment of its matrix, for one combination of upstream nodes.
#[derive(Debug, Clone)]
pub struct Node {
    /// `stage` or `stage[key=value,...]`, unique in the pipeline.
    pub id: String,
    pub stage: usize,
    /// Parameters with defaults applied, keys sorted (canonical).
    pub params: Params,
    /// The matrix values this node and its upstream nodes were expanded with, for display and joins.
    pub coords: Vec<(String, String)>,
    /// Indices (into `Plan::nodes`) of the nodes whose artifacts this node reads: first the
    /// `fan_out_inputs` nodes it was fanned out over, then the nodes it collects (`all`).
    pub inputs: Vec<usize>,
    /// A failed fan-out input skips this node; a failed collected input is passed on as failed
    /// (a report still shows what crashed).
    pub fan_out_inputs: usize,
}

#[derive(Debug)]
pub struct Plan {
    pub pipeline: Pipeline,
    /// Every node after all of its inputs.
    pub nodes: Vec<Node>,
}

impl Plan {
    pub fn expand(pipeline: Pipeline) -> Result<Plan, PipelineError> {
        let mut nodes: Vec<Node> = Vec::new();
        let mut nodes_of_stage: Vec<Vec<usize>> = Vec::with_capacity(pipeline.stages.len());
        for (stage_index, stage) in pipeline.stages.iter().enumerate() {
            let combos = upstream_combinations(stage, &nodes, &nodes_of_stage)?;
            let collected: Vec<usize> = stage
                .collect
                .iter()
                .flat_map(|&s| nodes_of_stage[s].iter().copied())
                .collect();
            let axes: Vec<Axis> = stage
                .matrix
                .iter()
                .map(|(key, values)| Axis::new(stage, key, values))
                .collect();
            // Sorted once here, with the matrix keys in place, so that every node only fills in
            // its values and cache keys can hash the parameters as they are.
            let mut template = stage.params.clone();
            for axis in &axes {
                template.insert(axis.key.clone(), Value::Null);
                for value in axis.values {
                    for (param, _) in presets::node_params(&stage.spec, &axis.key, value) {
                        template.entry(param).or_insert(Value::Null);
                    }
                }
            }
            template.sort_keys();
            let template = Arc::new(template);
            let keys: Vec<Arc<str>> = axes
                .iter()
                .map(|axis| Arc::from(axis.key.as_str()))
                .collect();
            let mut ids = Vec::new();
            let mut choice: Vec<Option<usize>> = vec![None; axes.len()];
            for (coords, inputs) in &combos {
                // A matrix key the upstream nodes already fixed joins too: only the assignment
                // with the upstream node's value pairs with it.
                let mut agrees = true;
                for (axis, fixed) in axes.iter().zip(choice.iter_mut()) {
                    *fixed = None;
                    if let Some((_, shown)) = coords.iter().find(|(k, _)| *k == axis.key) {
                        match axis.by_shown.get(shown.as_str()) {
                            Some(&index) => *fixed = Some(index),
                            None => agrees = false,
                        }
                    }
                }
                if !agrees {
                    continue;
                }
                let fan_out_inputs = inputs.len();
                let mut all_inputs = inputs.clone();
                all_inputs.extend(&collected);
                // An odometer over the free axes, the last one turning fastest.
                let mut at: Vec<usize> = choice.iter().map(|c| c.unwrap_or(0)).collect();
                loop {
                    if nodes.len() as u64 >= MAX_NODES {
                        return Err(too_many_nodes(stage));
                    }
                    let mut params = Params {
                        template: template.clone(),
                        own: Vec::with_capacity(axes.len()),
                    };
                    let mut node_coords = coords.clone();
                    for ((axis, &index), key) in axes.iter().zip(&at).zip(&keys) {
                        params.own.push((key.clone(), axis.values[index].clone()));
                        for (param, value) in
                            presets::node_params(&stage.spec, key, &axis.values[index])
                        {
                            params.own.push((Arc::from(param), value));
                        }
                        if !node_coords.iter().any(|(k, _)| *k == axis.key) {
                            node_coords.push((axis.key.clone(), axis.shown[index].clone()));
                        }
                    }
                    ids.push(nodes.len());
                    nodes.push(Node {
                        id: node_id(&stage.name, &node_coords),
                        stage: stage_index,
                        params,
                        coords: node_coords,
                        inputs: all_inputs.clone(),
                        fan_out_inputs,
                    });
                    let mut turned = false;
                    for position in (0..axes.len()).rev() {
                        if choice[position].is_some() {
                            continue;
                        }
                        if at[position] + 1 < axes[position].values.len() {
                            at[position] += 1;
                            turned = true;
                            break;
                        }
                        at[position] = 0;
                    }
                    if !turned {
                        break;
                    }
                }
            }
            if ids.is_empty() {
                let origin = Origin::Pipeline(pipeline.file.clone());
                let message = format!("stage `{}` expands to no nodes: no combination of its upstream nodes agrees on their shared matrix values", stage.name);
                return Err(PipelineError::Invalid(vec![Diagnostic::new(
                    origin, message,
                )]));
            }
            nodes_of_stage.push(ids);
        }
        let mut seen = std::collections::HashSet::with_capacity(nodes.len());
        for node in &nodes {
            if !seen.insert(node.id.as_str()) {
                let origin = Origin::Pipeline(pipeline.file.clone());
                let message = format!("two nodes would both be called `{}`", node.id);
                return Err(PipelineError::Invalid(vec![Diagnostic::new(
                    origin, message,
                )
                .hint("give the stage a matrix that tells them apart")]));
            }
        }
        Ok(Plan { pipeline, nodes })
    }

    pub fn stage_of(&self, node: &Node) -> &Stage {
        &self.pipeline.stages[node.stage]
    }

    /// Nodes matching `pattern`: a node id, or a stage name (all its nodes).
    pub fn select(&self, pattern: &str) -> Vec<usize> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, node)| node.id == pattern || self.stage_of(node).name == pattern)
            .map(|(index, _)| index)
            .collect()
    }
}

/// One matrix axis with each value as node ids show it, computed once rather than per node.
struct Axis<'a> {
    key: String,
    values: &'a [Value],
    shown: Vec<String>,
    by_shown: HashMap<String, usize>,
}

impl<'a> Axis<'a> {
    fn new(stage: &Stage, key: &str, values: &'a [Value]) -> Self {
        let shown: Vec<String> = values
            .iter()
            .map(|value| display_value(stage.param_type(key), value))
            .collect();
        let by_shown = shown
            .iter()
            .enumerate()
            .rev()
            .map(|(index, shown)| (shown.clone(), index))
            .collect();
        Axis {
            key: key.to_string(),
            values,
            shown,
            by_shown,
        }
    }
}

/// Combinations of upstream nodes: a natural join on shared matrix keys, so a stage that fans
/// out over two stages of one matrix pairs the nodes that belong together. Every node of a stage
/// has the same coordinate keys, so the join hashes the upstream nodes by the shared keys'
/// values instead of comparing every pair.
fn upstream_combinations(
    stage: &Stage,
    nodes: &[Node],
    nodes_of_stage: &[Vec<usize>],
) -> Result<Vec<(Coords, Vec<usize>)>, PipelineError> {
    let mut combos: Vec<(Coords, Vec<usize>)> = vec![(Vec::new(), Vec::new())];
    for &upstream in &stage.fan_out {
        let upstream_nodes = &nodes_of_stage[upstream];
        let Some(&first) = upstream_nodes.first() else {
            return Ok(Vec::new());
        };
        let Some((left, _)) = combos.first() else {
            return Ok(Vec::new());
        };
        let shared: Vec<&str> = nodes[first]
            .coords
            .iter()
            .map(|(key, _)| key.as_str())
            .filter(|key| left.iter().any(|(k, _)| k == key))
            .collect();
        let value_of = |coords: &[(String, String)], key: &str| -> String {
            coords
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        let mut by_values: HashMap<Vec<String>, Vec<usize>> = HashMap::new();
        for &node in upstream_nodes {
            let values = shared
                .iter()
                .map(|key| value_of(&nodes[node].coords, key))
                .collect();
            by_values.entry(values).or_default().push(node);
        }
        let mut joined = Vec::new();
        for (coords, inputs) in &combos {
            let values: Vec<String> = shared.iter().map(|key| value_of(coords, key)).collect();
            for &node in by_values.get(&values).map_or(&[][..], Vec::as_slice) {
                if joined.len() as u64 >= MAX_NODES {
                    return Err(too_many_nodes(stage));
                }
                let mut merged = coords.clone();
                for (key, value) in &nodes[node].coords {
                    if !coords.iter().any(|(k, _)| k == key) {
                        merged.push((key.clone(), value.clone()));
                    }
                }
                let mut inputs = inputs.clone();
                inputs.push(node);
                joined.push((merged, inputs));
            }
        }
        combos = joined;
    }
    Ok(combos)
}

fn too_many_nodes(stage: &Stage) -> PipelineError {
    let message = format!(
        "stage `{}` expands to more than {} nodes, the limit per plan (its matrix times the nodes of the stages it fans out over)",
        stage.name,
        crate::pipeline::limits::thousands(u128::from(MAX_NODES))
    );
    PipelineError::Invalid(vec![Diagnostic::new(stage.origin.clone(), message)])
}

fn display_value(ty: Option<&ParamType>, value: &Value) -> String {
    match (ty, value) {
        (Some(ParamType::Size), Value::Number(n)) => {
            n.as_u64().map(format_size).unwrap_or_else(|| n.to_string())
        }
        // Files are resolved to absolute paths; their name is what tells nodes apart.
        (Some(ParamType::File), Value::String(text)) => std::path::Path::new(text)
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or(text)
            .to_string(),
        (_, Value::String(text)) => text.clone(),
        (_, other) => other.to_string(),
    }
}

fn node_id(stage: &str, coords: &[(String, String)]) -> String {
    if coords.is_empty() {
        return stage.to_string();
    }
    let mut id = String::with_capacity(stage.len() + 16 * coords.len());
    id.push_str(stage);
    id.push('[');
    for (index, (key, value)) in coords.iter().enumerate() {
        if index > 0 {
            id.push(',');
        }
        let _ = write!(id, "{key}={value}");
    }
    id.push(']');
    id
}

/// Stages grouped by name, with their node counts: for summaries.
pub fn nodes_per_stage(plan: &Plan) -> BTreeMap<&str, usize> {
    let mut counts = BTreeMap::new();
    for node in &plan.nodes {
        *counts.entry(plan.stage_of(node).name.as_str()).or_insert(0) += 1;
    }
    counts
}

#[cfg(test)]
#[path = "plan_tests.rs"]
pub(crate) mod tests;
