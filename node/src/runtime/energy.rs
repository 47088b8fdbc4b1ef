//! Energy meters, wrapped around the engine span only (seed SPEC 001 §3.3).
//!
//! - [`RaplMeter`]: Linux RAPL through powercap sysfs, graded `HwShunt` only
//!   after a liveness probe saw the package counters advance under load, with
//!   counter wrap handled. Spans shorter than the counter's 10 ms minimum
//!   window are billed by the estimator instead, never zero.
//! - [`EstimatorMeter`]: a fixed power figure times the span's own length,
//!   graded `Estimator`.
//! - `NvmlMeter` (cargo feature `nvml`): NVIDIA's energy counter; it covers
//!   only the GPU, so on its own it is never graded `HwShunt`.
//!
//! A meter reads the whole node, not one request. A steward therefore bills
//! through [`Apportioned`]: the node's energy between any two events (a
//! serve starting or ending a computation, a mark) is split evenly among
//! the serves computing over it, so requests batched together share the
//! node's draw instead of each paying all of it, a serve waiting on the
//! network pays nothing, and the sum billed over any interval is at most
//! what the node used in it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mesh_protocol::mesh1::Energy;

/// Default power the estimator bills for a busy span: one busy desktop CPU
/// package, in milliwatts.
pub const DEFAULT_ESTIMATOR_MILLIWATTS: u64 = 35_000;
/// RAPL's minimum meaningful window.
pub const RAPL_MIN_WINDOW: Duration = Duration::from_millis(10);
/// Where the kernel publishes powercap zones.
pub const POWERCAP_ROOT: &str = "/sys/class/powercap";

/// A reading of the node's meter: when it was taken, and the counters
/// (none for the estimator); `ok` is false when a counter could not be read.
#[derive(Debug, Clone)]
pub struct MeterSpan {
    started: Instant,
    readings: Vec<u64>,
    ok: bool,
}

impl MeterSpan {
    /// A reading of no counters, now.
    fn now() -> Self {
        Self {
            started: Instant::now(),
            readings: Vec::new(),
            ok: true,
        }
    }
}

/// Something that meters the engine span.
pub trait EnergyMeter: Send + Sync + std::fmt::Debug {
    /// A short name for logs and `--json` output.
    fn name(&self) -> &str;
    /// Open a window immediately before the engine runs.
    fn begin(&self) -> MeterSpan;
    /// Close it immediately after; the figure covers only the span.
    fn end(&self, span: MeterSpan) -> Energy;
    /// The estimator it falls back to (the router's figure for work
    /// nothing was metered on yet).
    fn estimator(&self) -> EstimatorMeter;
    /// The node's energy between two readings (`begin`), of any length, as
    /// measured (`None` for a meter that measures nothing, or when a
    /// counter could not be read) and estimated µJ, never rounded up: the
    /// sums over consecutive readings are the energy of their union.
    fn between(&self, from: &MeterSpan, to: &MeterSpan) -> (Option<u64>, u64) {
        let elapsed = to.started.saturating_duration_since(from.started);
        (None, self.estimator().exact_uj(elapsed))
    }
    /// Whether this meter measures (its figures are graded above
    /// `Estimator` when they are long enough).
    fn measures(&self) -> bool {
        false
    }
    /// A span's figure from its share of the node's measured and estimated
    /// energy, graded as this meter grades a span of `elapsed`.
    fn energy_of(&self, measured: Option<u64>, estimated: u64, _elapsed: Duration) -> Energy {
        match measured {
            Some(measured) => Energy::hw_shunt(measured, estimated),
            None => Energy::estimator(estimated.max(1)),
        }
    }
}

/// Fixed-point scale of the shares [`Apportioned`] hands out (µJ × this).
const SHARE_SCALE: u128 = 1 << 32;

/// One serve's account in the ledger.
#[derive(Debug, Default)]
struct Account {
    /// Energy accrued (fixed point), measured and estimated.
    measured: u128,
    estimated: u128,
    /// Rows of its own in the passes running now (its weight), and the
    /// ledger's per-row totals when its weight last changed.
    weight: u64,
    at: (u128, u128),
    /// While it computes: since when; and the time it computed in all.
    since: Option<Instant>,
    computed: Duration,
}

/// What [`Apportioned`] has handed out.
#[derive(Debug)]
struct Ledger {
    /// The reading the last event took.
    last: MeterSpan,
    /// Rows being computed now, over every serve.
    weight: u64,
    /// Per row computed, all the energy handed out so far (fixed point).
    measured: u128,
    estimated: u128,
    accounts: std::collections::HashMap<u64, Account>,
    next: u64,
}

impl Ledger {
    /// An account brought up to the ledger's totals.
    fn settle(&mut self, id: u64) -> Option<&mut Account> {
        let totals = (self.measured, self.estimated);
        let account = self.accounts.get_mut(&id)?;
        let weight = u128::from(account.weight);
        account.measured += (totals.0 - account.at.0) * weight;
        account.estimated += (totals.1 - account.at.1) * weight;
        account.at = totals;
        Some(account)
    }
}

#[derive(Debug)]
struct Core {
    meter: Box<dyn EnergyMeter>,
    ledger: std::sync::Mutex<Ledger>,
}

impl Core {
    /// The ledger, brought up to now: the node's energy since the last
    /// event, per row computed over it (none computed: billed to no one).
    /// One reading closes the last interval and opens the next.
    fn advance(&self) -> std::sync::MutexGuard<'_, Ledger> {
        let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.meter.begin();
        let (measured, estimated) = self.meter.between(&ledger.last, &now);
        ledger.last = now;
        if ledger.weight > 0 {
            let weight = u128::from(ledger.weight);
            // A counter that could not be read is billed by the estimate
            // for that interval (never as a wrap, never as nothing).
            let measured = measured.unwrap_or(estimated);
            ledger.measured += u128::from(measured) * SHARE_SCALE / weight;
            ledger.estimated += u128::from(estimated) * SHARE_SCALE / weight;
        }
        ledger
    }

    fn enter(&self, id: u64, rows: u64) {
        let mut ledger = self.advance();
        let Some(account) = ledger.settle(id) else {
            return;
        };
        account.weight += rows;
        account.since.get_or_insert_with(Instant::now);
        ledger.weight += rows;
    }

    fn leave(&self, id: u64, rows: u64) {
        let mut ledger = self.advance();
        let Some(account) = ledger.settle(id) else {
            return;
        };
        account.weight = account.weight.saturating_sub(rows);
        if account.weight == 0
            && let Some(since) = account.since.take()
        {
            account.computed += since.elapsed();
        }
        ledger.weight = ledger.weight.saturating_sub(rows);
    }

    /// A serve's energy now.
    fn figure(&self, id: u64) -> Energy {
        let mut ledger = self.advance();
        let (measured, estimated, computed) = match ledger.settle(id) {
            Some(account) => (
                account.measured,
                account.estimated,
                account.computed + account.since.map_or(Duration::ZERO, |s| s.elapsed()),
            ),
            None => (0, 0, Duration::ZERO),
        };
        let whole = |share: u128| u64::try_from(share / SHARE_SCALE).unwrap_or(u64::MAX);
        self.meter.energy_of(
            self.meter.measures().then(|| whole(measured)),
            whole(estimated),
            computed,
        )
    }

    fn close(&self, id: u64) {
        let mut ledger = self.advance();
        if let Some(account) = ledger.accounts.remove(&id) {
            ledger.weight = ledger.weight.saturating_sub(account.weight);
        }
    }
}

/// A meter that bills each serve for the node's draw while the node
/// computes its rows: a forward pass's energy is split among the serves in
/// it by their rows (a 2,000-row prefill pays for its rows, not an equal
/// share with seven one-row decodes). A serve waiting on the network or in
/// a queue pays nothing; the node's idle draw is billed to no one. The sum
/// billed over any interval is at most what the node used in it.
#[derive(Debug, Clone)]
pub struct Apportioned {
    core: std::sync::Arc<Core>,
}

/// A serve's account (what its ticket holds): closed when ended or dropped.
#[derive(Debug)]
pub struct Share {
    bill: Bill,
}

impl Drop for Share {
    fn drop(&mut self) {
        self.bill.core.close(self.bill.id);
    }
}

/// What a pass is charged to: a serve's account, handed with its steps to
/// the batch worker that computes them.
#[derive(Debug, Clone)]
pub struct Bill {
    core: std::sync::Arc<Core>,
    id: u64,
}

impl Bill {
    /// The serve computes `rows` rows until the guard is dropped: the
    /// node's draw meanwhile is charged to it, by rows, with the other
    /// serves computing.
    pub fn computing(&self, rows: u64) -> Computing {
        let rows = rows.max(1);
        self.core.enter(self.id, rows);
        Computing {
            bill: self.clone(),
            rows,
        }
    }
}

/// Rows of one serve being computed; charged until dropped.
#[derive(Debug)]
pub struct Computing {
    bill: Bill,
    rows: u64,
}

impl Drop for Computing {
    fn drop(&mut self) {
        self.bill.core.leave(self.bill.id, self.rows);
    }
}

impl Share {
    /// What its passes are charged to.
    pub fn bill(&self) -> Bill {
        self.bill.clone()
    }
}

impl Apportioned {
    pub fn new(meter: Box<dyn EnergyMeter>) -> Self {
        let last = meter.begin();
        Self {
            core: std::sync::Arc::new(Core {
                meter,
                ledger: std::sync::Mutex::new(Ledger {
                    last,
                    weight: 0,
                    measured: 0,
                    estimated: 0,
                    accounts: Default::default(),
                    next: 0,
                }),
            }),
        }
    }

    pub fn name(&self) -> &str {
        self.core.meter.name()
    }

    pub fn estimator(&self) -> EstimatorMeter {
        self.core.meter.estimator()
    }

    /// Open a serve's account.
    pub fn begin(&self) -> Share {
        let mut ledger = self.core.advance();
        let id = ledger.next;
        ledger.next += 1;
        let at = (ledger.measured, ledger.estimated);
        ledger.accounts.insert(
            id,
            Account {
                at,
                ..Account::default()
            },
        );
        Share {
            bill: Bill {
                core: self.core.clone(),
                id,
            },
        }
    }

    /// The serve's energy so far; its account stays open.
    pub fn so_far(&self, share: &Share) -> Energy {
        share.bill.core.figure(share.bill.id)
    }

    /// Close the serve's account: its energy.
    pub fn end(&self, share: Share) -> Energy {
        share.bill.core.figure(share.bill.id)
    }
}

/// Bills `milliwatts × span length`, at least 1 µJ.
#[derive(Debug, Clone)]
pub struct EstimatorMeter {
    pub milliwatts: u64,
}

impl Default for EstimatorMeter {
    fn default() -> Self {
        Self {
            milliwatts: DEFAULT_ESTIMATOR_MILLIWATTS,
        }
    }
}

impl EstimatorMeter {
    /// The estimate for a span of `elapsed`, never zero.
    pub fn estimate_uj(&self, elapsed: Duration) -> u64 {
        self.exact_uj(elapsed).max(1)
    }

    /// The estimate for `elapsed`, rounded down (zero for a short enough
    /// window).
    fn exact_uj(&self, elapsed: Duration) -> u64 {
        // mW × ns / 10^6 = µJ
        let uj = u128::from(self.milliwatts) * elapsed.as_nanos() / 1_000_000;
        u64::try_from(uj).unwrap_or(u64::MAX)
    }
}

impl EnergyMeter for EstimatorMeter {
    fn name(&self) -> &str {
        "estimator"
    }
    fn begin(&self) -> MeterSpan {
        MeterSpan::now()
    }
    fn end(&self, span: MeterSpan) -> Energy {
        Energy::estimator(self.estimate_uj(span.started.elapsed()))
    }
    fn estimator(&self) -> EstimatorMeter {
        self.clone()
    }
}

/// One RAPL package domain.
#[derive(Debug, Clone)]
struct RaplZone {
    energy_file: PathBuf,
    max_range_uj: u64,
}

/// Linux RAPL package counters, summed over packages.
#[derive(Debug, Clone)]
pub struct RaplMeter {
    zones: Vec<RaplZone>,
    estimator: EstimatorMeter,
    min_window: Duration,
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

impl RaplMeter {
    /// Find the package zones under a powercap root (`intel-rapl:N` whose
    /// `name` starts with `package`). `None` when there are none or they are
    /// unreadable (often: not root).
    pub fn discover(root: &Path, estimator: EstimatorMeter) -> Result<Self, String> {
        let entries = std::fs::read_dir(root).map_err(|e| format!("{}: {e}", root.display()))?;
        let mut zones = Vec::new();
        for entry in entries.flatten() {
            let dir = entry.path();
            let is_top_zone = dir
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("intel-rapl:") && n.matches(':').count() == 1);
            let is_package = std::fs::read_to_string(dir.join("name"))
                .is_ok_and(|n| n.trim().starts_with("package"));
            if !(is_top_zone && is_package) {
                continue;
            }
            let energy_file = dir.join("energy_uj");
            if read_u64(&energy_file).is_none() {
                return Err(format!(
                    "{} is not readable (RAPL usually needs root)",
                    energy_file.display()
                ));
            }
            let max_range_uj = read_u64(&dir.join("max_energy_range_uj")).unwrap_or(u64::MAX);
            zones.push(RaplZone {
                energy_file,
                max_range_uj,
            });
        }
        if zones.is_empty() {
            return Err(format!("no RAPL package zones under {}", root.display()));
        }
        zones.sort_by(|a, b| a.energy_file.cmp(&b.energy_file));
        Ok(Self {
            zones,
            estimator,
            min_window: RAPL_MIN_WINDOW,
        })
    }

    /// Every zone's counter, or `None` when one could not be read.
    fn read(&self) -> Option<Vec<u64>> {
        self.zones
            .iter()
            .map(|z| read_u64(&z.energy_file))
            .collect()
    }

    fn reading(&self) -> MeterSpan {
        let readings = self.read();
        MeterSpan {
            started: Instant::now(),
            ok: readings.is_some(),
            readings: readings.unwrap_or_default(),
        }
    }

    /// Energy between two readings of every zone, across a wrap.
    fn delta(&self, before: &[u64], after: &[u64]) -> u64 {
        self.zones
            .iter()
            .zip(before.iter().zip(after))
            .map(|(zone, (b, a))| {
                if a >= b {
                    a - b
                } else {
                    // The counter wrapped at max_energy_range_uj.
                    zone.max_range_uj.saturating_sub(*b).saturating_add(*a)
                }
            })
            .fold(0u64, u64::saturating_add)
    }

    /// The liveness probe: sample every `interval` while `load` burns CPU;
    /// live when the counters advanced in at least 4 of every 5 intervals,
    /// over at least 5 intervals.
    pub fn probe_live(
        &self,
        intervals: usize,
        interval: Duration,
        load: &mut dyn FnMut(Duration),
    ) -> Result<(), String> {
        let mut advanced = 0;
        let mut previous = self.read();
        for _ in 0..intervals {
            load(interval);
            let now = self.read();
            if let (Some(before), Some(after)) = (&previous, &now)
                && self.delta(before, after) > 0
            {
                advanced += 1;
            }
            previous = now;
        }
        if intervals >= 5 && advanced * 5 >= intervals * 4 {
            Ok(())
        } else {
            Err(format!(
                "the RAPL counter advanced in only {advanced} of {intervals} intervals under load (frozen or republished in lumps)"
            ))
        }
    }
}

impl EnergyMeter for RaplMeter {
    fn name(&self) -> &str {
        "rapl"
    }
    fn estimator(&self) -> EstimatorMeter {
        self.estimator.clone()
    }
    fn begin(&self) -> MeterSpan {
        self.reading()
    }
    fn end(&self, span: MeterSpan) -> Energy {
        let now = self.reading();
        let (measured, estimate) = self.between(&span, &now);
        self.energy_of(
            measured,
            estimate,
            now.started.saturating_duration_since(span.started),
        )
    }
    fn between(&self, from: &MeterSpan, to: &MeterSpan) -> (Option<u64>, u64) {
        let estimate = self
            .estimator
            .exact_uj(to.started.saturating_duration_since(from.started));
        let measured = (from.ok && to.ok).then(|| self.delta(&from.readings, &to.readings));
        (measured, estimate)
    }
    fn measures(&self) -> bool {
        true
    }
    fn energy_of(&self, measured: Option<u64>, estimated: u64, elapsed: Duration) -> Energy {
        match measured {
            // Below the counter's minimum window its delta is noise, often 0.
            Some(measured) if elapsed >= self.min_window => Energy::hw_shunt(measured, estimated),
            _ => Energy::estimator(estimated.max(1)),
        }
    }
}

/// Burn one core for `duration` (the probe's load).
pub fn burn_cpu(duration: Duration) {
    let until = Instant::now() + duration;
    let mut state = [0u8; 64];
    while Instant::now() < until {
        for _ in 0..256 {
            let digest = blake3::hash(&state);
            state[..32].copy_from_slice(digest.as_bytes());
        }
    }
    std::hint::black_box(state);
}

/// Pick the meter: RAPL when readable and live, else the estimator. Returns
/// the meter and a line saying which and why, for the start-up report.
pub fn select_meter(
    powercap_root: &Path,
    estimator: EstimatorMeter,
) -> (Box<dyn EnergyMeter>, String) {
    match RaplMeter::discover(powercap_root, estimator.clone()) {
        Ok(rapl) => match rapl.probe_live(6, Duration::from_millis(60), &mut burn_cpu) {
            Ok(()) => (
                Box::new(rapl.clone()),
                format!(
                    "energy meter: RAPL ({} package zone(s), live under load; spans under 10 ms billed by the estimator)",
                    rapl.zones.len()
                ),
            ),
            Err(why) => (
                Box::new(estimator.clone()),
                format!(
                    "energy meter: estimator at {} mW, because {why}",
                    estimator.milliwatts
                ),
            ),
        },
        Err(why) => (
            Box::new(estimator.clone()),
            format!(
                "energy meter: estimator at {} mW (receipts say Estimator), because {why}",
                estimator.milliwatts
            ),
        ),
    }
}

#[cfg(feature = "nvml")]
pub use nvml::NvmlMeter;

#[cfg(feature = "nvml")]
mod nvml {
    //! NVIDIA's total-energy counter (millijoules). It covers the GPU only,
    //! so a figure from it alone is `ModelBased` (GPU reading plus the CPU
    //! estimate), never `HwShunt`; with a live RAPL meter beside it the sum
    //! covers the whole request and is graded `HwShunt`.
    use super::*;
    use nvml_wrapper::Nvml;

    /// The counter's minimum meaningful window.
    pub const NVML_MIN_WINDOW: Duration = Duration::from_millis(100);

    #[derive(Debug)]
    pub struct NvmlMeter {
        nvml: Nvml,
        device_index: u32,
        cpu: Option<RaplMeter>,
        estimator: EstimatorMeter,
    }

    impl NvmlMeter {
        pub fn new(
            device_index: u32,
            cpu: Option<RaplMeter>,
            estimator: EstimatorMeter,
        ) -> Result<Self, String> {
            let nvml = Nvml::init().map_err(|e| format!("NVML: {e}"))?;
            nvml.device_by_index(device_index)
                .and_then(|d| d.total_energy_consumption())
                .map_err(|e| format!("NVML device {device_index}: {e}"))?;
            Ok(Self {
                nvml,
                device_index,
                cpu,
                estimator,
            })
        }

        fn gpu_mj(&self) -> Option<u64> {
            self.nvml
                .device_by_index(self.device_index)
                .and_then(|d| d.total_energy_consumption())
                .ok()
        }
    }

    impl EnergyMeter for NvmlMeter {
        fn name(&self) -> &str {
            "nvml"
        }
        fn estimator(&self) -> EstimatorMeter {
            self.estimator.clone()
        }
        fn begin(&self) -> MeterSpan {
            let cpu = match &self.cpu {
                Some(rapl) => rapl.read(),
                None => Some(Vec::new()),
            };
            let readings = cpu.zip(self.gpu_mj()).map(|(mut readings, gpu)| {
                readings.push(gpu);
                readings
            });
            MeterSpan {
                started: Instant::now(),
                ok: readings.is_some(),
                readings: readings.unwrap_or_default(),
            }
        }
        fn end(&self, span: MeterSpan) -> Energy {
            let now = self.begin();
            let (measured, estimate) = self.between(&span, &now);
            self.energy_of(
                measured,
                estimate,
                now.started.saturating_duration_since(span.started),
            )
        }
        fn between(&self, from: &MeterSpan, to: &MeterSpan) -> (Option<u64>, u64) {
            let estimate = self
                .estimator
                .exact_uj(to.started.saturating_duration_since(from.started));
            if !(from.ok && to.ok) {
                return (None, estimate);
            }
            let split = |readings: &[u64]| {
                let (cpu, gpu) = readings.split_at(readings.len().saturating_sub(1));
                (cpu.to_vec(), gpu.first().copied().unwrap_or(0))
            };
            let ((cpu_before, gpu_before), (cpu_after, gpu_after)) =
                (split(&from.readings), split(&to.readings));
            let gpu_uj = gpu_after.saturating_sub(gpu_before).saturating_mul(1000);
            let cpu_uj = self
                .cpu
                .as_ref()
                .map_or(0, |rapl| rapl.delta(&cpu_before, &cpu_after));
            (Some(gpu_uj.saturating_add(cpu_uj)), estimate)
        }
        fn measures(&self) -> bool {
            true
        }
        fn energy_of(&self, measured: Option<u64>, estimated: u64, elapsed: Duration) -> Energy {
            match (measured, &self.cpu) {
                (Some(_), _) if elapsed < NVML_MIN_WINDOW => Energy::estimator(estimated.max(1)),
                (Some(measured), Some(_)) => Energy::hw_shunt(measured, estimated),
                // The GPU's reading plus the CPU's estimate.
                (Some(gpu), None) => Energy::model_based(gpu.saturating_add(estimated)),
                (None, _) => Energy::estimator(estimated.max(1)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_protocol::mesh1::Provenance;

    fn fake_powercap(packages: &[(u64, u64)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (i, (energy, max)) in packages.iter().enumerate() {
            let zone = root.path().join(format!("intel-rapl:{i}"));
            std::fs::create_dir_all(zone.join(format!("intel-rapl:{i}:0"))).unwrap();
            std::fs::write(zone.join("name"), format!("package-{i}\n")).unwrap();
            std::fs::write(zone.join("energy_uj"), format!("{energy}\n")).unwrap();
            std::fs::write(zone.join("max_energy_range_uj"), format!("{max}\n")).unwrap();
        }
        // A DRAM zone is not a package and is not summed.
        let dram = root.path().join("intel-rapl:0/intel-rapl:0:0");
        std::fs::write(dram.join("name"), "dram\n").unwrap();
        std::fs::write(dram.join("energy_uj"), "5\n").unwrap();
        root
    }

    fn set(root: &Path, package: usize, value: u64) {
        std::fs::write(
            root.join(format!("intel-rapl:{package}/energy_uj")),
            format!("{value}\n"),
        )
        .unwrap();
    }

    #[test]
    fn estimator_is_never_zero_and_scales_with_the_span() {
        let e = EstimatorMeter { milliwatts: 10_000 };
        assert_eq!(e.estimate_uj(Duration::ZERO), 1);
        assert_eq!(e.estimate_uj(Duration::from_millis(1)), 10_000);
        assert_eq!(e.estimate_uj(Duration::from_secs(2)), 20_000_000);
        let energy = e.end(e.begin());
        assert_eq!(energy.provenance(), Provenance::Estimator);
        assert_eq!(energy.measured_uj(), None);
    }

    #[test]
    fn rapl_sums_packages_and_handles_wrap() {
        let root = fake_powercap(&[(900, 1_000), (50, 10_000)]);
        let meter = RaplMeter::discover(root.path(), EstimatorMeter::default()).unwrap();
        let span = meter.begin();
        set(root.path(), 0, 100); // wrapped: 900 -> 1000 -> 100 is 200
        set(root.path(), 1, 350); // 300
        std::thread::sleep(RAPL_MIN_WINDOW + Duration::from_millis(2));
        let energy = meter.end(span);
        assert_eq!(energy.provenance(), Provenance::HwShunt);
        assert_eq!(energy.measured_uj(), Some(500));
    }

    #[test]
    fn rapl_bills_short_spans_by_the_estimator() {
        let root = fake_powercap(&[(0, u64::MAX)]);
        let meter = RaplMeter::discover(root.path(), EstimatorMeter::default()).unwrap();
        let span = meter.begin();
        set(root.path(), 0, 7);
        let energy = meter.end(span);
        assert_eq!(energy.provenance(), Provenance::Estimator);
        assert!(energy.uj() >= 1);
    }

    #[test]
    fn frozen_counter_is_not_live_and_falls_back() {
        let root = fake_powercap(&[(42, u64::MAX)]);
        let meter = RaplMeter::discover(root.path(), EstimatorMeter::default()).unwrap();
        let mut nothing = |_: Duration| {};
        assert!(meter.probe_live(5, Duration::ZERO, &mut nothing).is_err());
        let (chosen, why) = select_meter(root.path(), EstimatorMeter::default());
        assert_eq!(chosen.name(), "estimator");
        assert!(why.contains("advanced in only 0"), "{why}");
        // A counter that advances with the load is live.
        let path = root.path().to_path_buf();
        let mut value = 42;
        let mut advancing = |_: Duration| {
            value += 1000;
            set(&path, 0, value);
        };
        assert!(meter.probe_live(5, Duration::ZERO, &mut advancing).is_ok());
        // Republished in lumps: advances in only 2 of 5 intervals.
        let mut tick = 0;
        let mut lumpy = |_: Duration| {
            tick += 1;
            if tick % 3 == 0 {
                value += 1000;
                set(&path, 0, value);
            }
        };
        assert!(meter.probe_live(5, Duration::ZERO, &mut lumpy).is_err());
    }

    /// E1 (issue 37): eight serves computing at once share the node's
    /// power: the sum billed is the node's draw over the time any computed,
    /// not eight times it; one serve alone pays all of it.
    #[test]
    fn serves_computing_at_once_share_the_node_power() {
        let watts = EstimatorMeter { milliwatts: 35_000 };
        let meter = Apportioned::new(Box::new(watts.clone()));
        let started = Instant::now();
        let spans: Vec<Share> = (0..8).map(|_| meter.begin()).collect();
        let computing: Vec<Computing> = spans.iter().map(|s| s.bill().computing(1)).collect();
        std::thread::sleep(Duration::from_millis(200));
        drop(computing);
        let billed: u64 = spans.into_iter().map(|span| meter.end(span).uj()).sum();
        let node = watts.estimate_uj(started.elapsed());
        assert!(
            billed <= node,
            "8 serves billed {billed} µJ, the node drew {node} µJ"
        );
        assert!(billed * 10 >= node * 9, "{billed} of {node} µJ billed");
        // Alone, a serve pays the node's whole draw while it computes.
        let started = Instant::now();
        let alone = meter.begin();
        let computing = alone.bill().computing(1);
        std::thread::sleep(Duration::from_millis(50));
        drop(computing);
        let billed = meter.end(alone).uj();
        assert!(billed <= watts.estimate_uj(started.elapsed()));
        assert!(billed >= watts.estimate_uj(Duration::from_millis(50)));
    }

    #[test]
    fn a_serve_pays_only_while_it_computes_and_its_share_of_each_interval() {
        let watts = EstimatorMeter { milliwatts: 10_000 };
        let meter = Apportioned::new(Box::new(watts));
        let first = meter.begin();
        let second = meter.begin();
        let alone = first.bill().computing(1);
        std::thread::sleep(Duration::from_millis(100));
        let peek = meter.so_far(&first).uj();
        let together = second.bill().computing(1);
        std::thread::sleep(Duration::from_millis(100));
        drop((alone, together));
        // Neither computes: waiting on the network is not billed.
        std::thread::sleep(Duration::from_millis(100));
        let first = meter.end(first).uj();
        let second = meter.end(second).uj();
        // The first paid 100 ms alone and half of the next 100 ms.
        assert!((1_000_000..=1_200_000).contains(&peek), "{peek}");
        assert!((1_400_000..=1_700_000).contains(&first), "{first}");
        assert!((450_000..=650_000).contains(&second), "{second}");
        // A serve dropped while computing stops sharing.
        let dropped = meter.begin();
        let computing = dropped.bill().computing(1);
        drop(dropped);
        drop(computing);
        let alone = meter.begin();
        let computing = alone.bill().computing(1);
        std::thread::sleep(Duration::from_millis(20));
        drop(computing);
        assert!(meter.end(alone).uj() >= 200_000);
    }

    /// A pass is charged by rows: a long prefill batched with short decodes
    /// pays for its rows, not an equal share.
    #[test]
    fn a_pass_is_charged_to_its_serves_by_their_rows() {
        let meter = Apportioned::new(Box::new(EstimatorMeter { milliwatts: 10_000 }));
        let prefill = meter.begin();
        let decodes: Vec<Share> = (0..7).map(|_| meter.begin()).collect();
        let pass: Vec<Computing> = std::iter::once(prefill.bill().computing(2000))
            .chain(decodes.iter().map(|d| d.bill().computing(1)))
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        drop(pass);
        let prefill = meter.end(prefill).uj();
        let decodes: Vec<u64> = decodes.into_iter().map(|d| meter.end(d).uj()).collect();
        assert!(prefill > 990_000, "{prefill}");
        assert!(decodes.iter().all(|d| *d < 1_000), "{decodes:?}");
    }

    /// A counter that cannot be read is billed by the estimate for that
    /// interval: never read as a wrap of the counter.
    #[test]
    fn an_unreadable_counter_is_billed_by_the_estimate_not_as_a_wrap() {
        let root = fake_powercap(&[(500, 1_000_000)]);
        let rapl = RaplMeter::discover(root.path(), EstimatorMeter { milliwatts: 1_000 }).unwrap();
        let meter = Apportioned::new(Box::new(rapl));
        let share = meter.begin();
        let computing = share.bill().computing(1);
        std::fs::remove_file(root.path().join("intel-rapl:0/energy_uj")).unwrap();
        std::thread::sleep(RAPL_MIN_WINDOW + Duration::from_millis(5));
        let _ = meter.so_far(&share);
        set(root.path(), 0, 600);
        drop(computing);
        let energy = meter.end(share);
        assert!(energy.uj() < 100_000, "{energy:?}");
    }

    #[test]
    fn missing_powercap_reports_why() {
        let (chosen, why) = select_meter(
            Path::new("/nonexistent/powercap"),
            EstimatorMeter::default(),
        );
        assert_eq!(chosen.name(), "estimator");
        assert!(why.contains("/nonexistent/powercap"), "{why}");
    }
}
