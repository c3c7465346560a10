//! Prometheus metrics of the server itself (served at `/metrics` without sandbox headers).

use std::sync::atomic::AtomicI64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    plane: &'static str,
    method: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

/// The server's metric registry.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    ops: Family<OpLabels, Histogram>,
    sandboxes: Family<StateLabels, Gauge<i64, AtomicI64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("agentenv");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP requests by plane, method and status",
            requests.clone(),
        );
        let ops = Family::<OpLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 16))
        });
        registry.register(
            "sandbox_op_seconds",
            "Runtime lifecycle operation latency",
            ops.clone(),
        );
        let sandboxes = Family::<StateLabels, Gauge<i64, AtomicI64>>::default();
        registry.register("sandboxes", "Sandboxes by state", sandboxes.clone());
        Metrics {
            registry,
            requests,
            ops,
            sandboxes,
        }
    }

    /// Counts one answered request; `data_plane` says whether it was proxied to a sandbox.
    /// `method` is the client's: any method outside the standard set counts as `OTHER`, so
    /// unauthenticated requests cannot grow the label set.
    pub fn count_request(&self, data_plane: bool, method: &str, status: u16) {
        let plane = if data_plane { "data" } else { "control" };
        self.requests
            .get_or_create(&RequestLabels {
                plane,
                method: bounded_method(method).to_string(),
                status,
            })
            .inc();
    }

    /// Prometheus text exposition, with the sandbox gauges set to `(running, paused)`.
    pub fn render(&self, running: usize, paused: usize) -> String {
        self.sandboxes
            .get_or_create(&StateLabels { state: "running" })
            .set(running as i64);
        self.sandboxes
            .get_or_create(&StateLabels { state: "paused" })
            .set(paused as i64);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String");
        out
    }
}

/// The standard HTTP methods keep their name; anything else is `OTHER`.
fn bounded_method(m: &str) -> &str {
    const KNOWN: [&str; 7] = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"];
    KNOWN.into_iter().find(|k| *k == m).unwrap_or("OTHER")
}

impl agentenv_control::sandboxes::OpObserver for Metrics {
    /// Records the latency of a lifecycle operation (`create`, `pause`, `resume`, `kill`).
    fn observe_op(&self, op: &'static str, d: Duration) {
        self.ops
            .get_or_create(&OpLabels { op })
            .observe(d.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentenv_control::sandboxes::OpObserver;

    #[test]
    fn client_methods_cannot_grow_the_label_set() {
        let m = Metrics::new();
        for i in 0..500 {
            m.count_request(false, &format!("X{i}{}", rand::random::<u32>()), 405);
        }
        let text = m.render(0, 0);
        let lines = text
            .lines()
            .filter(|l| l.starts_with("agentenv_http_requests_total{"))
            .collect::<Vec<_>>();
        assert_eq!(
            lines,
            ["agentenv_http_requests_total{plane=\"control\",method=\"OTHER\",status=\"405\"} 500"]
        );
    }

    #[test]
    fn exposition_counts_what_happened() {
        let m = Metrics::new();
        let n = 1 + rand::random::<u8>() as u64 % 20;
        for _ in 0..n {
            m.count_request(false, "GET", 200);
        }
        m.count_request(true, "POST", 502);
        m.observe_op("create", Duration::from_millis(120));
        let text = m.render(3, 2);
        assert!(text.contains(&format!("agentenv_http_requests_total{{plane=\"control\",method=\"GET\",status=\"200\"}} {n}")), "{text}");
        assert!(text.contains(
            "agentenv_http_requests_total{plane=\"data\",method=\"POST\",status=\"502\"} 1"
        ));
        assert!(text.contains("agentenv_sandboxes{state=\"running\"} 3"));
        assert!(text.contains("agentenv_sandbox_op_seconds_count{op=\"create\"} 1"));
        assert!(text.trim_end().ends_with("# EOF"));
    }
}
