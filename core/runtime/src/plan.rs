//! Matrix expansion: a validated pipeline becomes a list of nodes in dependency order.

use std::collections::BTreeMap;
use std::fmt::Write;

use attnbench_sdk::{format_size, ParamType};
use serde_json::{Map, Value};

use crate::diagnostic::{Diagnostic, Origin};
use crate::pipeline::{Pipeline, PipelineError, Stage};

/// A node's matrix coordinates: (axis, value) pairs.
type Coords = Vec<(String, String)>;

/// One unit of work: a stage with one assignment of its matrix, for one combination of upstream nodes.
#[derive(Debug, Clone)]
pub struct Node {
    /// `stage` or `stage[key=value,...]`, unique in the pipeline.
    pub id: String,
    pub stage: usize,
    /// Parameters with defaults applied, keys sorted (canonical).
    pub params: Map<String, Value>,
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
            // Combinations of upstream nodes: a natural join on shared matrix keys, so a stage that
            // fans out over two stages of one matrix pairs the nodes that belong together.
            let mut combos: Vec<(Coords, Vec<usize>)> = vec![(Vec::new(), Vec::new())];
            for &upstream in &stage.fan_out {
                let mut joined = Vec::new();
                for (coords, inputs) in &combos {
                    for &node in &nodes_of_stage[upstream] {
                        if let Some(merged) = join(coords, &nodes[node].coords) {
                            let mut inputs = inputs.clone();
                            inputs.push(node);
                            joined.push((merged, inputs));
                        }
                    }
                }
                combos = joined;
            }
            let collected: Vec<usize> = stage
                .collect
                .iter()
                .flat_map(|&s| nodes_of_stage[s].iter().copied())
                .collect();
            let assignments = matrix_assignments(stage);
            let mut ids = Vec::with_capacity(combos.len() * assignments.len());
            for (coords, inputs) in &combos {
                for assignment in &assignments {
                    // A matrix key the upstream nodes already fixed joins too: only the
                    // upstream node with the same value pairs with this assignment.
                    let disagrees = assignment.iter().any(|(key, value)| {
                        let shown = display_value(stage.param_type(key), value);
                        coords.iter().any(|(k, v)| k == key && *v != shown)
                    });
                    if disagrees {
                        continue;
                    }
                    let mut params = stage.params.clone();
                    let mut node_coords = coords.clone();
                    for (key, value) in assignment {
                        params.insert(key.clone(), value.clone());
                        let shown = display_value(stage.param_type(key), value);
                        match node_coords.iter_mut().find(|(k, _)| k == key) {
                            Some(existing) => existing.1 = shown,
                            None => node_coords.push((key.clone(), shown)),
                        }
                    }
                    // Sorted once here, so cache keys can hash the parameters as they are.
                    params.sort_keys();
                    let fan_out_inputs = inputs.len();
                    let mut all_inputs = inputs.clone();
                    all_inputs.extend(&collected);
                    ids.push(nodes.len());
                    nodes.push(Node {
                        id: node_id(&stage.name, &node_coords),
                        stage: stage_index,
                        params,
                        coords: node_coords,
                        inputs: all_inputs,
                        fan_out_inputs,
                    });
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

fn join(left: &[(String, String)], right: &[(String, String)]) -> Option<Coords> {
    let mut merged = left.to_vec();
    for (key, value) in right {
        match left.iter().find(|(k, _)| k == key) {
            Some((_, existing)) if existing != value => return None,
            Some(_) => {}
            None => merged.push((key.clone(), value.clone())),
        }
    }
    Some(merged)
}

fn matrix_assignments(stage: &Stage) -> Vec<Vec<(String, Value)>> {
    let mut assignments: Vec<Vec<(String, Value)>> = vec![Vec::new()];
    for (key, values) in &stage.matrix {
        assignments = assignments
            .into_iter()
            .flat_map(|assignment| {
                values.iter().map(move |value| {
                    let mut next = assignment.clone();
                    next.push((key.clone(), value.clone()));
                    next
                })
            })
            .collect();
    }
    assignments
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
