//! Discovery and open of a software provider's single device, written once over
//! `SoftProvider` (the verbs `Provider`: its [`DeviceInfo`], which names it serves, the
//! device-name check), the bind address a context listens on, and the handle a context gives
//! out to itself.

use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use crate::provider::{ContextOps, Provider};
use crate::{DeviceConfig, DeviceInfo, Result, Transport, VerbsError};

/// A software provider: one device, opened by starting a context.
pub(crate) trait SoftProvider: Send + Sync + 'static {
    /// The provider's name; its device names start with it.
    const PROVIDER: &'static str;
    /// The one device.
    const DEVICE: &'static str;
    /// How the device moves bytes.
    const TRANSPORT: Transport;
    /// High bits of the device GUID (the process id fills the low bits, so two processes'
    /// devices differ).
    const GUID_TAG: u64;
    /// What the device is, in words.
    const DESCRIPTION: &'static str;

    /// Start a context of the device described by `info`.
    fn start(&self, info: DeviceInfo, config: &DeviceConfig) -> Result<Arc<dyn ContextOps>>;
}

fn device_info<P: SoftProvider>() -> DeviceInfo {
    DeviceInfo {
        name: P::DEVICE.to_string(),
        provider: P::PROVIDER.to_string(),
        transport: P::TRANSPORT,
        guid: P::GUID_TAG | u64::from(std::process::id()),
        description: P::DESCRIPTION.to_string(),
    }
}

impl<P: SoftProvider> Provider for P {
    fn name(&self) -> &'static str {
        P::PROVIDER
    }
    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(vec![device_info::<P>()])
    }
    fn serves(&self, device: &str) -> bool {
        device.starts_with(P::PROVIDER)
    }
    fn open(&self, device: &str, config: &DeviceConfig) -> Result<Arc<dyn ContextOps>> {
        if device != P::DEVICE {
            return Err(VerbsError::NoDevice(device.to_string()));
        }
        self.start(device_info::<P>(), config)
    }
}

/// The address a context binds: `DeviceConfig::bind_addr`, else the environment variable
/// `env`, else `127.0.0.1:0`.
pub fn bind_addr(config: &DeviceConfig, env: &str) -> Result<SocketAddr> {
    if let Some(a) = config.bind_addr {
        return Ok(a);
    }
    match std::env::var(env) {
        Ok(s) if !s.is_empty() => s.parse().map_err(|e| {
            VerbsError::InvalidArgument(format!("{env}={s:?} is not a socket address: {e}"))
        }),
        _ => Ok(SocketAddr::from(([127, 0, 0, 1], 0))),
    }
}

/// A strong handle of a context from its own `Weak` (an error once it is being dropped).
pub fn upgrade<T>(weak: &Weak<T>, device: &str) -> Result<Arc<T>> {
    weak.upgrade()
        .ok_or_else(|| VerbsError::InvalidArgument(format!("{device} context is closing")))
}
