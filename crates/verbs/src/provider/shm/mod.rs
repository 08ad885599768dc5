//! Provider `shm` (being built).

use std::sync::Arc;

use crate::provider::{ContextOps, Provider};
use crate::{DeviceConfig, DeviceInfo, Result, VerbsError};

/// The `shm` provider.
pub struct ShmProvider;

impl Provider for ShmProvider {
    fn name(&self) -> &'static str {
        "shm"
    }
    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(Vec::new())
    }
    fn serves(&self, device: &str) -> bool {
        device.starts_with("shm")
    }
    fn open(&self, device: &str, _config: &DeviceConfig) -> Result<Arc<dyn ContextOps>> {
        Err(VerbsError::NoDevice(device.to_string()))
    }
}
