//! Provider `tcp` (being built).

use std::sync::Arc;

use crate::provider::{ContextOps, Provider};
use crate::{DeviceConfig, DeviceInfo, Result, VerbsError};

/// The `tcp` provider.
pub struct TcpProvider;

impl Provider for TcpProvider {
    fn name(&self) -> &'static str {
        "tcp"
    }
    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(Vec::new())
    }
    fn serves(&self, device: &str) -> bool {
        device.starts_with("tcp")
    }
    fn open(&self, device: &str, _config: &DeviceConfig) -> Result<Arc<dyn ContextOps>> {
        Err(VerbsError::NoDevice(device.to_string()))
    }
}
