//! Prometheus metrics: VMs by phase, how long kvirt takes to start a VM,
//! reconcile errors by reason and what the start-up adoption found; served
//! as text on a local address (`[metrics] listen`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Every phase a VMI can show, so each series exists from the start.
const PHASES: [&str; 6] = [
    "Pending",
    "Scheduling",
    "Scheduled",
    "Running",
    "Succeeded",
    "Failed",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabel {
    step: &'static str,
}

/// A step's time: a directory in a millisecond, a stop waits out a guest's
/// grace (seconds to minutes).
fn step_histogram() -> Histogram {
    Histogram::new([
        0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
    ])
}

/// A VM, by its VMI's namespace and name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VmLabel {
    namespace: String,
    name: String,
}

/// The figures of the migrations this host sends now, per VM (as
/// KubeVirt's `kubevirt_vmi_migration_data_*` metrics).
#[derive(Default)]
struct Moving {
    total: Family<VmLabel, Gauge>,
    processed: Family<VmLabel, Gauge>,
    remaining: Family<VmLabel, Gauge>,
    iterations: Family<VmLabel, Gauge>,
}

impl Moving {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "migration_data_total_bytes",
            "Guest memory and disks a running migration moves",
            self.total.clone(),
        );
        registry.register(
            "migration_data_processed_bytes",
            "What a running migration has sent so far",
            self.processed.clone(),
        );
        registry.register(
            "migration_data_remaining_bytes",
            "What a running migration has still to send",
            self.remaining.clone(),
        );
        registry.register(
            "migration_iterations",
            "Passes over guest memory a running migration has made",
            self.iterations.clone(),
        );
    }
}

/// What kvirtd found of a VM when it started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// Running, wanted, kept as it was.
    Adopted,
    /// On the host with no VMI (or an old instance): removed.
    Cleaned,
    /// Wanted, but found broken (e.g. its unit gone): failed.
    Failed,
}

impl Adoption {
    fn as_str(self) -> &'static str {
        match self {
            Adoption::Adopted => "adopted",
            Adoption::Cleaned => "cleaned",
            Adoption::Failed => "failed",
        }
    }
}

pub struct Metrics {
    registry: Registry,
    vms: Family<PhaseLabel, Gauge>,
    start: Histogram,
    steps: Family<StepLabel, Histogram, fn() -> Histogram>,
    errors: Family<ReasonLabel, Counter>,
    adoptions: Family<ResultLabel, Counter>,
    deferred: Counter,
    migrations: Family<ResultLabel, Counter>,
    migration: Histogram,
    downtime: Histogram,
    moving: Moving,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kvirt");
        let vms = Family::<PhaseLabel, Gauge>::default();
        // From the first pass to a running domain: namespace, network, unit,
        // define and start; 50 ms to ~100 s.
        let start = Histogram::new([0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 100.0]);
        let steps =
            Family::<StepLabel, Histogram, fn() -> Histogram>::new_with_constructor(step_histogram);
        registry.register(
            "step_duration_seconds",
            "Time each step of a VM's start or teardown took, by step (where a burst or a mass delete spends its time)",
            steps.clone(),
        );
        let errors = Family::<ReasonLabel, Counter>::default();
        let adoptions = Family::<ResultLabel, Counter>::default();
        registry.register("vms", "VMs on this host by VMI phase", vms.clone());
        registry.register(
            "vm_start_duration_seconds",
            "Time kvirtd took to bring a VM from nothing to a running domain",
            start.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconciles and VM starts, by reason",
            errors.clone(),
        );
        registry.register(
            "adoptions",
            "VMs found on the host at start-up, by what became of them",
            adoptions.clone(),
        );
        let deferred = Counter::default();
        registry.register(
            "status_writes_deferred",
            "Status writes held back by the per-VM or per-host write budget (their changes go out with a later write)",
            deferred.clone(),
        );
        let migrations = Family::<ResultLabel, Counter>::default();
        registry.register(
            "migrations",
            "Live migrations this host sent, by how they ended (succeeded: the VM runs at the target)",
            migrations.clone(),
        );
        // An idle guest moves in about a second; a busy one in minutes.
        let migration = Histogram::new([0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1200.0]);
        registry.register(
            "migration_duration_seconds",
            "Time a live migration this host sent took, from the request to the target's commit",
            migration.clone(),
        );
        let downtime = Histogram::new([0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]);
        registry.register(
            "migration_downtime_seconds",
            "How long the guest was paused at a migration's switch-over, as the target's libvirt measured it",
            downtime.clone(),
        );
        let moving = Moving::default();
        moving.register(&mut registry);
        Self {
            registry,
            vms,
            start,
            steps,
            errors,
            adoptions,
            deferred,
            migrations,
            migration,
            downtime,
            moving,
        }
    }
}

impl Metrics {
    pub fn set_phases(&self, counts: &BTreeMap<String, usize>) {
        for phase in PHASES {
            let n = counts.get(phase).copied().unwrap_or(0);
            self.vms
                .get_or_create(&PhaseLabel {
                    phase: phase.into(),
                })
                .set(n as i64);
        }
    }

    pub fn started(&self, took: Duration) {
        self.start.observe(took.as_secs_f64());
    }

    pub fn step(&self, step: &'static str, took: Duration) {
        self.steps
            .get_or_create(&StepLabel { step })
            .observe(took.as_secs_f64());
    }

    pub fn status_write_deferred(&self) {
        self.deferred.inc();
    }

    pub fn error(&self, reason: &str) {
        self.errors
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn adoption(&self, a: Adoption) {
        self.adoptions
            .get_or_create(&ResultLabel {
                result: a.as_str().into(),
            })
            .inc();
    }

    /// A migration this host sent ended: `Some` with its time and the
    /// guest's pause (when the target knew it) if the VM left.
    pub fn migration(&self, moved: Option<(Duration, Option<Duration>)>) {
        let result = if moved.is_some() {
            "succeeded"
        } else {
            "failed"
        };
        self.migrations
            .get_or_create(&ResultLabel {
                result: result.into(),
            })
            .inc();
        if let Some((took, downtime)) = moved {
            self.migration.observe(took.as_secs_f64());
            if let Some(d) = downtime {
                self.downtime.observe(d.as_secs_f64());
            }
        }
    }

    /// The figures of `vm`'s migration running now; `None`: it ended, its
    /// series go.
    pub fn migrating(
        &self,
        vm: &crate::core::key::VmKey,
        p: Option<&crate::host::migrate::Progress>,
    ) {
        let label = VmLabel {
            namespace: vm.namespace().into(),
            name: vm.name().into(),
        };
        let m = &self.moving;
        let families = [&m.total, &m.processed, &m.remaining, &m.iterations];
        let Some(p) = p else {
            for f in families {
                f.remove(&label);
            }
            return;
        };
        let values = [
            p.data_total,
            p.data_processed,
            p.data_remaining,
            p.iterations,
        ];
        for (f, v) in families.into_iter().zip(values) {
            f.get_or_create(&label)
                .set(i64::try_from(v).unwrap_or(i64::MAX));
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How many scrapes are served at once, and how long one may take: a
/// client that connects and says nothing holds a slot that long at most.
#[derive(Clone, Copy, Debug)]
pub struct ServeLimits {
    pub connections: usize,
    pub per_connection: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            connections: 16,
            per_connection: Duration::from_secs(5),
        }
    }
}

/// A minimal HTTP/1.1 server: `GET /metrics` answers `render()`, anything
/// else 404. One request per connection; nothing here is worth a framework.
pub async fn serve(listener: TcpListener, render: impl Fn() -> String + Send + Sync + 'static) {
    serve_with(listener, render, ServeLimits::default(), Default::default()).await
}

/// [`serve`] with its limits; `busy` counts the connections being served.
pub async fn serve_with(
    listener: TcpListener,
    render: impl Fn() -> String + Send + Sync + 'static,
    limits: ServeLimits,
    busy: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::Ordering;
    let render = std::sync::Arc::new(render);
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(limits.connections));
    let mut backoff = Duration::ZERO;
    loop {
        // Past the limit, connections wait in the kernel's backlog.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut conn = match listener.accept().await {
            Ok((conn, _)) => {
                backoff = Duration::ZERO;
                conn
            }
            Err(e) => {
                // Out of file descriptors, say: retrying at once would spin.
                if backoff.is_zero() {
                    tracing::warn!("metrics endpoint: accept: {e}; backing off");
                }
                backoff = (backoff * 2).clamp(Duration::from_millis(50), Duration::from_secs(2));
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        let render = render.clone();
        let busy = busy.clone();
        busy.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let _ = tokio::time::timeout(limits.per_connection, answer(&mut conn, &*render)).await;
            busy.fetch_sub(1, Ordering::SeqCst);
            drop(slot);
        });
    }
}

async fn answer(conn: &mut tokio::net::TcpStream, render: &(dyn Fn() -> String + Send + Sync)) {
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    // Read up to the end of the headers (or give up on a huge request).
    while len < buf.len() {
        match conn.read(&mut buf[len..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => len += n,
        }
        if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf[..len]);
    let mut parts = head.split_whitespace();
    let response = match (parts.next(), parts.next()) {
        (Some("GET"), Some("/metrics")) => {
            let body = render();
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
        }
        _ => "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string(),
    };
    let _ = conn.write_all(response.as_bytes()).await;
    let _ = conn.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_phase_has_a_series_and_counts_are_encoded() {
        let m = Metrics::default();
        m.set_phases(&BTreeMap::from([("Running".to_string(), 2)]));
        m.started(Duration::from_millis(1500));
        m.step("stop_unit", Duration::from_millis(700));
        m.error("libvirt");
        m.adoption(Adoption::Adopted);
        let text = m.encode();
        for want in [
            "kvirt_vms{phase=\"Running\"} 2",
            "kvirt_vms{phase=\"Failed\"} 0",
            "kvirt_vm_start_duration_seconds_bucket{le=\"2.5\"} 1",
            "kvirt_vm_start_duration_seconds_bucket{le=\"1.0\"} 0",
            "kvirt_step_duration_seconds_bucket{le=\"1.0\",step=\"stop_unit\"} 1",
            "kvirt_step_duration_seconds_bucket{le=\"0.5\",step=\"stop_unit\"} 0",
            "kvirt_reconcile_errors_total{reason=\"libvirt\"} 1",
            "kvirt_adoptions_total{result=\"adopted\"} 1",
        ] {
            assert!(text.contains(want), "{want} missing from\n{text}");
        }
        // A phase that empties goes back to zero rather than vanishing.
        m.set_phases(&BTreeMap::new());
        assert!(m.encode().contains("kvirt_vms{phase=\"Running\"} 0"));
    }

    #[test]
    fn migrations_count_by_result_with_their_time_and_the_guests_pause() {
        let m = Metrics::default();
        m.migration(Some((
            Duration::from_millis(1300),
            Some(Duration::from_millis(40)),
        )));
        m.migration(Some((Duration::from_secs(20), None)));
        m.migration(None);
        let text = m.encode();
        for want in [
            "kvirt_migrations_total{result=\"succeeded\"} 2",
            "kvirt_migrations_total{result=\"failed\"} 1",
            "kvirt_migration_duration_seconds_bucket{le=\"2.5\"} 1",
            "kvirt_migration_duration_seconds_count 2",
            "kvirt_migration_downtime_seconds_bucket{le=\"0.05\"} 1",
            "kvirt_migration_downtime_seconds_count 1",
        ] {
            assert!(text.contains(want), "{want} missing from\n{text}");
        }
    }

    #[test]
    fn a_running_migrations_figures_are_series_of_its_vm_until_it_ends() {
        let m = Metrics::default();
        let vm = crate::core::key::VmKey::new("ns", "a").unwrap();
        let p = crate::host::migrate::Progress {
            data_total: 1000,
            data_processed: 700,
            data_remaining: 300,
            iterations: 2,
            ..Default::default()
        };
        m.migrating(&vm, Some(&p));
        let text = m.encode();
        for want in [
            "kvirt_migration_data_total_bytes{namespace=\"ns\",name=\"a\"} 1000",
            "kvirt_migration_data_processed_bytes{namespace=\"ns\",name=\"a\"} 700",
            "kvirt_migration_data_remaining_bytes{namespace=\"ns\",name=\"a\"} 300",
            "kvirt_migration_iterations{namespace=\"ns\",name=\"a\"} 2",
        ] {
            assert!(text.contains(want), "{want} missing from\n{text}");
        }
        m.migrating(&vm, None);
        assert!(!m.encode().contains("name=\"a\""));
    }

    #[tokio::test]
    async fn the_endpoint_answers_get_metrics_only() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, || "kvirt_vms 1\n".to_string()));
        let get = |path: &'static str| async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut out = String::new();
            c.read_to_string(&mut out).await.unwrap();
            out
        };
        let ok = get("/metrics").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains(CONTENT_TYPE));
        assert!(ok.ends_with("\r\n\r\nkvirt_vms 1\n"), "{ok}");
        assert!(get("/").await.starts_with("HTTP/1.1 404"));
    }

    /// Clients that connect and say nothing hold at most the limit of
    /// slots, each for at most its time; a scrape behind them is served.
    #[tokio::test]
    async fn idle_connections_cannot_exhaust_the_endpoint() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let busy = Arc::new(AtomicUsize::new(0));
        let limits = ServeLimits {
            connections: 3,
            per_connection: Duration::from_millis(300),
        };
        tokio::spawn(serve_with(
            listener,
            || "kvirt_vms 1\n".into(),
            limits,
            busy.clone(),
        ));
        let mut idle = Vec::new();
        for _ in 0..30 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut most = 0;
        while most < 3 {
            most = most.max(busy.load(Ordering::SeqCst));
            assert!(tokio::time::Instant::now() < deadline, "never busy");
            tokio::task::yield_now().await;
        }
        let scrape = async {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            c.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await.unwrap();
            let mut out = String::new();
            c.read_to_string(&mut out).await.unwrap();
            out
        };
        tokio::pin!(scrape);
        let out = loop {
            tokio::select! {
                out = &mut scrape => break out,
                _ = tokio::time::sleep(Duration::from_millis(5)) => {
                    most = most.max(busy.load(Ordering::SeqCst));
                    assert!(tokio::time::Instant::now() < deadline, "scrape starved");
                }
            }
        };
        assert!(out.ends_with("kvirt_vms 1\n"), "{out}");
        assert_eq!(most, 3, "never more than the limit at once");
    }
}
