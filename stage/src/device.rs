//! Where the engine computes: chosen once per process (`--device`), opened
//! once, and handed to every slice the model loads.

use std::cell::Cell;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use candle_core::Device;

use crate::error::{EngineError, Result};

/// A compute device as a user names it: `cpu`, `cuda` (the first GPU) or
/// `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    #[default]
    Cpu,
    Cuda(usize),
}

/// Most GPU ordinals a name may give: far above any one machine's count,
/// so a typo is refused here rather than by the driver.
pub const MAX_CUDA_ORDINAL: usize = 255;

impl FromStr for DeviceChoice {
    type Err = EngineError;

    fn from_str(text: &str) -> Result<Self> {
        let text = text.trim();
        let wrong = || {
            EngineError::Device(format!(
                "`{text}` names no device: name `cpu`, `cuda` or `cuda:N` (N a GPU's ordinal, 0 the first)"
            ))
        };
        match text.split_once(':') {
            None if text.eq_ignore_ascii_case("cpu") => Ok(Self::Cpu),
            None if text.eq_ignore_ascii_case("cuda") => Ok(Self::Cuda(0)),
            Some((kind, ordinal)) if kind.eq_ignore_ascii_case("cuda") => {
                match ordinal.parse::<usize>() {
                    Ok(n) if n <= MAX_CUDA_ORDINAL => Ok(Self::Cuda(n)),
                    _ => Err(wrong()),
                }
            }
            _ => Err(wrong()),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceChoice {
    /// Whether this binary can compute on such a device at all.
    pub fn compiled_in(self) -> bool {
        match self {
            Self::Cpu => true,
            Self::Cuda(_) => candle_core::utils::cuda_is_available(),
        }
    }

    /// Open the device: for a GPU this creates its context and stream once
    /// per process, and every later open of that ordinal shares them (a
    /// bench's runs no longer make a context each), so the threads that
    /// drop its tensors can be bound to it ([`bind_opened_devices`]). The
    /// context lives until the process ends. A binary built without the
    /// `cuda` feature says how to get one that has it.
    pub fn open(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(_) if !self.compiled_in() => Err(EngineError::Device(format!(
                "device {self}: this mesh-node was built without GPU support; rebuild it with \
                 `cargo build --release -p mesh-node --features cuda` (needs CUDA's nvcc), \
                 or run on `--device cpu`"
            ))),
            Self::Cuda(ordinal) => {
                let mut opened = OPENED.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some((_, device)) = opened.iter().find(|(n, _)| *n == ordinal) {
                    return Ok(device.clone());
                }
                let device = Device::new_cuda(ordinal).map_err(|error| {
                    EngineError::Device(format!(
                        "device {self}: cannot open the GPU ({}); check `nvidia-smi` lists it and \
                         the driver matches the CUDA the binary was built with",
                        crate::error::candle_message(&error)
                    ))
                })?;
                opened.push((ordinal, device.clone()));
                OPENED_COUNT.store(opened.len(), Ordering::Release);
                Ok(device)
            }
        }
    }
}

/// The GPUs this process opened, by ordinal.
static OPENED: Mutex<Vec<(usize, Device)>> = Mutex::new(Vec::new());

/// How many GPUs are in [`OPENED`]: a thread that bound that many has
/// nothing to do.
static OPENED_COUNT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// How many opened GPUs this thread has bound.
    static BOUND: Cell<usize> = const { Cell::new(0) };
}

/// Make the context of every GPU this process opened current on the
/// calling thread; after the first call on a thread, one atomic load.
///
/// cudarc frees a GPU tensor's memory on the thread that drops it without
/// binding the context there first (0.19's `CudaSlice::drop`). On a thread
/// that never made the context current the free fails, the memory stays
/// allocated, and the error is held for the next call on any thread,
/// presumably what failed a forward pass once on an H200 with
/// `CUDA_ERROR_INVALID_CONTEXT` (`bench split --device cuda`). The async
/// runtime's threads call this as they start and as they wake, and a pass
/// run off them as it begins, so what they drop is freed. A
/// process computes on one GPU (`--device`); with several, the last one
/// opened would be current.
///
/// Frees made this way run on the dropping thread's stream, not ordered
/// after the producing thread's work. Every pass ends by copying its output
/// to the host, which waits for that work, so a tensor dropped after its
/// pass is idle.
///
/// An error met while binding comes back for the caller to report, once: an
/// error held from an earlier call (the binding is then made anyway), or a
/// binding that failed (not retried on this thread).
pub fn bind_opened_devices() -> std::result::Result<(), String> {
    let opened = OPENED_COUNT.load(Ordering::Acquire);
    if BOUND.with(Cell::get) == opened {
        return Ok(());
    }
    BOUND.with(|bound| bound.set(opened));
    #[cfg(feature = "cuda")]
    return bind_cuda_contexts();
    #[cfg(not(feature = "cuda"))]
    Ok(())
}

/// Bind every opened GPU's context to this thread; the errors met, if any.
#[cfg(feature = "cuda")]
fn bind_cuda_contexts() -> std::result::Result<(), String> {
    let mut errors = Vec::new();
    for (ordinal, device) in OPENED.lock().unwrap_or_else(PoisonError::into_inner).iter() {
        if let Device::Cuda(cuda) = device {
            let context = cuda.cuda_stream().context().clone();
            // `bind_to_thread` first hands over an error held from an
            // earlier call, and then does not bind: bind again.
            if let Err(error) = context.bind_to_thread() {
                errors.push(format!(
                    "cuda:{ordinal}: held from an earlier call: {error}"
                ));
                if let Err(error) = context.bind_to_thread() {
                    errors.push(format!("cuda:{ordinal}: cannot bind its context: {error}"));
                }
            }
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// How an opened device is named, as `--device` names it: `cpu`, or
/// `cuda:N` (what a node advertises to a mesh as its device).
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => DeviceChoice::Cpu.to_string(),
        candle_core::DeviceLocation::Cuda { gpu_id } => DeviceChoice::Cuda(gpu_id).to_string(),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Bytes free now on a GPU, for the weights and caches a mesh planner may
/// place there; `None` for the CPU, whose memory is the host's.
pub fn gpu_free_memory(device: &Device) -> Result<Option<u64>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => {
            let unreadable = |error: String| {
                EngineError::Device(format!("cannot read the GPU's free memory: {error}"))
            };
            // Freed memory goes back to the stream's pool asynchronously:
            // a slice dropped just before (the speed measurement's) counts
            // as free only once the stream has caught up.
            device
                .synchronize()
                .map_err(|e| unreadable(crate::error::candle_message(&e)))?;
            let (free, _total) = cuda
                .cuda_stream()
                .context()
                .mem_get_info()
                .map_err(|e| unreadable(e.to_string()))?;
            Ok(Some(free as u64))
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print_back() {
        for (text, choice) in [
            ("cpu", DeviceChoice::Cpu),
            ("CPU", DeviceChoice::Cpu),
            ("cuda", DeviceChoice::Cuda(0)),
            ("cuda:0", DeviceChoice::Cuda(0)),
            (" cuda:3 ", DeviceChoice::Cuda(3)),
        ] {
            assert_eq!(text.parse::<DeviceChoice>().unwrap(), choice, "{text}");
            assert_eq!(choice.to_string().parse::<DeviceChoice>().unwrap(), choice);
        }
        for bad in [
            "", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:256", "cpu:0", "metal",
        ] {
            let error = bad.parse::<DeviceChoice>().unwrap_err().to_string();
            assert!(error.contains("cuda:N"), "{bad}: {error}");
        }
    }

    #[test]
    fn the_cpu_always_opens_and_a_gpu_only_when_built_in() {
        let cpu = DeviceChoice::Cpu.open().unwrap();
        assert!(cpu.is_cpu());
        assert_eq!(device_name(&cpu), "cpu");
        assert_eq!(gpu_free_memory(&cpu).unwrap(), None);
        if !DeviceChoice::Cuda(0).compiled_in() {
            let error = DeviceChoice::Cuda(0).open().unwrap_err().to_string();
            assert!(error.contains("--features cuda"), "{error}");
        }
    }
}
