//! The placement policy: a pure function from what the cluster looks like to the node a new sandbox goes
//! to. No I/O, no clock, no randomness: the same view gives the same node on every gateway.
//!
//! A node is eligible when it is not excluded (it refused this create already), it can host the source
//! (a template must be on the node, or on a node sharing its bucket when this one shares it too: templates
//! built there are published to the bucket; a snapshot can be imported from the shared bucket by any node), and
//! after the sandbox it still has memory and stays within its `max_running`. Among eligible nodes the
//! highest score wins:
//!
//! `score = 1.5·local + (1 − vcpu load) + free memory fraction + 1 / (1 + sandboxes)`
//!
//! where `local` is 1 when the node already holds the source's files (no download), the loads count
//! the placements it has not reported yet, and ties go to fewer sandboxes, then the smaller id.

use crate::schema::NodeRecord;

/// Weight of snapshot locality: more than any one load term, less than all of them together, so a
/// local node wins unless it is much busier.
pub const LOCALITY_WEIGHT: f64 = 1.5;

/// Placements a node has not reported yet (claims newer than its record).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pending {
    pub sandboxes: u32,
    pub vcpus: u32,
    pub memory_mb: u64,
}

/// One node as placement sees it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub node: &'a NodeRecord,
    pub pending: Pending,
}

/// What the new sandbox needs.
#[derive(Debug, Clone, Copy)]
pub struct Demand<'a> {
    pub vcpus: u32,
    pub memory_mb: u64,
    /// `templateID` of the create: a template id or alias, or a snapshot id or scoped name.
    pub source: &'a str,
    /// Nodes that already refused this create.
    pub exclude: &'a [String],
}

/// The chosen node.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub node: String,
    pub url: String,
    /// Whether it holds the source's files (template or snapshot) already.
    pub local: bool,
    pub score: f64,
}

/// Why no node fits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unplaceable {
    #[error("no node is registered in the cluster")]
    NoNodes,
    #[error("no node has room for {vcpus} vCPUs and {memory_mb} MiB ({nodes} nodes considered)")]
    NoCapacity {
        nodes: usize,
        vcpus: u32,
        memory_mb: u64,
    },
}

/// Picks the node for `demand` among `candidates`.
pub fn place(candidates: &[Candidate<'_>], demand: &Demand<'_>) -> Result<Choice, Unplaceable> {
    if candidates.is_empty() {
        return Err(Unplaceable::NoNodes);
    }
    // A template lives on the nodes that hold it, and in the bucket when one of them shares it (any node
    // sharing the bucket imports it on first use); a snapshot (or a name no node knows as a template)
    // can go anywhere.
    let holds = |n: &NodeRecord| n.templates.iter().any(|t| t == demand.source);
    let template_somewhere = candidates.iter().any(|c| holds(c.node));
    let template_shared = candidates
        .iter()
        .any(|c| holds(c.node) && c.node.shared_store);
    let mut best: Option<(f64, u32, &NodeRecord, bool)> = None;
    for c in candidates {
        let n = c.node;
        if demand.exclude.contains(&n.id) {
            continue;
        }
        if template_somewhere && !holds(n) && !(template_shared && n.shared_store) {
            continue;
        }
        let sandboxes = n.running.saturating_add(c.pending.sandboxes);
        if n.max_running.is_some_and(|m| sandboxes >= m) {
            continue;
        }
        let free_after = n
            .free_memory_mb
            .checked_sub(c.pending.memory_mb)
            .and_then(|f| f.checked_sub(demand.memory_mb));
        let Some(free_after) = free_after else {
            continue;
        };
        let vcpus = u64::from(n.vcpus_used) + u64::from(c.pending.vcpus) + u64::from(demand.vcpus);
        let local = if template_somewhere {
            holds(n)
        } else {
            n.snapshots.iter().any(|s| s == demand.source)
        };
        let cpu_load = vcpus as f64 / f64::from(n.cpus.max(1));
        let mem_free = free_after as f64 / n.memory_mb.max(1) as f64;
        let score = LOCALITY_WEIGHT * f64::from(u8::from(local))
            + (1.0 - cpu_load.min(1.0))
            + mem_free.min(1.0)
            + 1.0 / (1.0 + f64::from(sandboxes));
        let better = match &best {
            None => true,
            Some((s, k, b, _)) => score > *s || (score == *s && (sandboxes, &n.id) < (*k, &b.id)),
        };
        if better {
            best = Some((score, sandboxes, n, local));
        }
    }
    best.map(|(score, _, n, local)| Choice {
        node: n.id.clone(),
        url: n.url.clone(),
        local,
        score,
    })
    .ok_or(Unplaceable::NoCapacity {
        nodes: candidates.len(),
        vcpus: demand.vcpus,
        memory_mb: demand.memory_mb,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::SCHEMA_VERSION;

    fn node(id: &str, running: u32) -> NodeRecord {
        NodeRecord {
            version: SCHEMA_VERSION,
            id: id.into(),
            url: format!("http://{id}"),
            cpus: 16,
            vcpus_used: running * 2,
            memory_mb: 64 * 1024,
            free_memory_mb: 64 * 1024 - u64::from(running) * 512,
            running,
            paused: 0,
            max_running: None,
            templates: vec!["base".into()],
            snapshots: vec![],
            shared_store: true,
            updated_at_ms: 0,
            sizes: Default::default(),
        }
    }

    fn demand(source: &str) -> Demand<'_> {
        Demand {
            vcpus: 2,
            memory_mb: 512,
            source,
            exclude: &[],
        }
    }

    fn cands(nodes: &[NodeRecord]) -> Vec<Candidate<'_>> {
        nodes
            .iter()
            .map(|node| Candidate {
                node,
                pending: Pending::default(),
            })
            .collect()
    }

    #[test]
    fn the_least_loaded_node_wins() {
        let nodes = [node("a", 3), node("b", 1), node("c", 2)];
        assert_eq!(place(&cands(&nodes), &demand("base")).unwrap().node, "b");
    }

    #[test]
    fn pending_placements_count_as_load() {
        let nodes = [node("a", 0), node("b", 0)];
        let mut c = cands(&nodes);
        c[0].pending = Pending {
            sandboxes: 1,
            vcpus: 2,
            memory_mb: 512,
        };
        assert_eq!(place(&c, &demand("base")).unwrap().node, "b");
    }

    #[test]
    fn successive_placements_spread_over_equal_nodes() {
        let nodes = [node("a", 0), node("b", 0), node("c", 0)];
        let mut c = cands(&nodes);
        let mut picked = vec![];
        for _ in 0..3 {
            let choice = place(&c, &demand("base")).unwrap();
            let i = c.iter().position(|x| x.node.id == choice.node).unwrap();
            c[i].pending.sandboxes += 1;
            c[i].pending.vcpus += 2;
            c[i].pending.memory_mb += 512;
            picked.push(choice.node);
        }
        picked.sort();
        assert_eq!(picked, ["a", "b", "c"]);
    }

    #[test]
    fn a_node_holding_the_snapshot_wins_over_a_slightly_idler_one() {
        let mut a = node("a", 2);
        a.snapshots = vec!["snap-1".into()];
        let nodes = [a, node("b", 1)];
        let choice = place(&cands(&nodes), &demand("snap-1")).unwrap();
        assert_eq!((choice.node.as_str(), choice.local), ("a", true));
        // ...but not over a much idler one.
        let mut busy = node("a", 7);
        busy.snapshots = vec!["snap-1".into()];
        busy.vcpus_used = 16;
        busy.free_memory_mb = 2048;
        let nodes = [busy, node("b", 0)];
        assert_eq!(place(&cands(&nodes), &demand("snap-1")).unwrap().node, "b");
    }

    #[test]
    fn templates_go_only_where_they_are() {
        let mut b = node("b", 5);
        b.templates.push("my-app".into());
        let nodes = [node("a", 0), b];
        assert_eq!(place(&cands(&nodes), &demand("my-app")).unwrap().node, "b");
        // A name no node has as a template is a snapshot: anywhere.
        assert_eq!(place(&cands(&nodes), &demand("snap-x")).unwrap().node, "a");
    }

    #[test]
    fn a_template_in_the_shared_bucket_goes_to_any_node_sharing_it() {
        let alone = |mut n: NodeRecord| {
            n.shared_store = false;
            n
        };
        let mut busy = node("b", 7);
        busy.templates.push("my-app".into());
        busy.vcpus_used = 16;
        busy.free_memory_mb = 2048;
        // The busy holder shares the bucket: an idle node sharing it too imports the template; one
        // without the bucket never gets it.
        let nodes = [alone(node("a", 0)), busy.clone(), node("c", 0)];
        let choice = place(&cands(&nodes), &demand("my-app")).unwrap();
        assert_eq!((choice.node.as_str(), choice.local), ("c", false));
        let exclude = ["b".to_string(), "c".to_string()];
        let d = Demand {
            exclude: &exclude,
            ..demand("my-app")
        };
        assert!(place(&cands(&nodes), &d).is_err());
        // A holder about as idle wins: its files are local.
        let mut idle = node("b", 1);
        idle.templates.push("my-app".into());
        let nodes = [node("a", 0), idle];
        let choice = place(&cands(&nodes), &demand("my-app")).unwrap();
        assert_eq!((choice.node.as_str(), choice.local), ("b", true));
        // A holder without the bucket keeps its template to itself.
        let nodes = [node("a", 0), alone(busy)];
        assert_eq!(place(&cands(&nodes), &demand("my-app")).unwrap().node, "b");
    }

    #[test]
    fn full_nodes_and_excluded_nodes_are_skipped() {
        let mut a = node("a", 0);
        a.free_memory_mb = 100;
        let mut b = node("b", 2);
        b.max_running = Some(2);
        let nodes = [a, b, node("c", 9)];
        assert_eq!(place(&cands(&nodes), &demand("base")).unwrap().node, "c");
        let exclude = ["c".to_string()];
        let d = Demand {
            exclude: &exclude,
            ..demand("base")
        };
        assert_eq!(
            place(&cands(&nodes), &d),
            Err(Unplaceable::NoCapacity {
                nodes: 3,
                vcpus: 2,
                memory_mb: 512
            })
        );
        assert_eq!(place(&[], &d), Err(Unplaceable::NoNodes));
    }

    #[test]
    fn ties_go_to_the_smaller_id() {
        let nodes = [node("b", 0), node("a", 0)];
        assert_eq!(place(&cands(&nodes), &demand("base")).unwrap().node, "a");
    }

    #[test]
    fn a_source_is_sized_as_its_nodes_report_it() {
        use crate::schema::MachineSize;
        use crate::store::{ClusterView, Versioned};
        let big = MachineSize {
            vcpus: 8,
            memory_mb: 8192,
        };
        let mut a = node("a", 0);
        a.snapshots.push("big".into());
        a.sizes.insert("big".into(), big);
        a.free_memory_mb = 4096;
        let b = node("b", 3);
        let view = ClusterView {
            nodes: [a, b]
                .into_iter()
                .map(|value| Versioned {
                    value,
                    create_revision: 1,
                    mod_revision: 1,
                })
                .collect(),
            claims: vec![],
        };
        assert_eq!(view.size_of("big"), Some(big));
        assert_eq!(view.size_of("other"), None);
        // The node holding the snapshot lacks the memory for its size: the other one gets it.
        let d = Demand {
            vcpus: big.vcpus,
            memory_mb: big.memory_mb,
            source: "big",
            exclude: &[],
        };
        assert_eq!(place(&view.candidates(), &d).unwrap().node, "b");
        let small = Demand {
            memory_mb: 512,
            ..d
        };
        assert_eq!(place(&view.candidates(), &small).unwrap().node, "a");
    }

    proptest::proptest! {
        #[test]
        fn the_choice_is_always_eligible_and_best(
            loads in proptest::collection::vec((0u32..20, 0u64..65536, proptest::option::of(1u32..20)), 1..12),
            mem in 1u64..4096,
        ) {
            let nodes: Vec<NodeRecord> = loads.iter().enumerate().map(|(i, (r, free, max))| {
                let mut n = node(&format!("n{i:02}"), *r);
                n.free_memory_mb = *free;
                n.max_running = *max;
                n
            }).collect();
            let c = cands(&nodes);
            let d = Demand { vcpus: 1, memory_mb: mem, source: "base", exclude: &[] };
            let fits = |n: &NodeRecord| n.free_memory_mb >= mem && n.max_running.is_none_or(|m| n.running < m);
            match place(&c, &d) {
                Ok(choice) => {
                    let chosen = nodes.iter().find(|n| n.id == choice.node).unwrap();
                    proptest::prop_assert!(fits(chosen));
                    // Deterministic: the same view gives the same node.
                    proptest::prop_assert_eq!(place(&c, &d).unwrap(), choice);
                }
                Err(_) => proptest::prop_assert!(!nodes.iter().any(fits)),
            }
        }
    }
}
