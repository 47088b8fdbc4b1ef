//! A running node: the serving core, transport, steward, journal, records,
//! energy meters and keys.

use std::path::Path;

use mesh_stage::ModelHandle;

pub mod client;
pub mod clock;
pub mod energy;
pub mod http;
pub mod journal;
pub mod keys;
pub mod limit;
pub mod mesh;
pub mod net;
pub mod planner;
pub mod records;
pub mod router;
pub mod serve;
pub mod steward;

/// Make the opened GPU's context current on this thread, so a GPU tensor
/// it drops is freed (`mesh_stage::bind_opened_devices`): the async
/// runtime's threads call it as they start and wake, and a pass run off
/// them as it begins. Nothing to do on the CPU, or once bound.
pub fn bind_gpu_to_this_thread() {
    if let Err(error) = mesh_stage::bind_opened_devices() {
        tracing::warn!(%error, "binding the GPU's context to a thread reported an error");
    }
}

/// Open a model; the error names the file once (most engine errors name it
/// already).
pub fn open_model(path: &Path) -> anyhow::Result<ModelHandle> {
    ModelHandle::open(path).map_err(|error| {
        let named = error.to_string().contains(&path.display().to_string());
        let error = anyhow::Error::new(error);
        if named {
            error
        } else {
            error.context(format!("opening model {}", path.display()))
        }
    })
}
