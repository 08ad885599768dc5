//! Endpoint configuration: one documented format, set from code, from a TOML file, or from
//! `FABRIQ_*` environment variables (which override the file).
//!
//! ```toml
//! # fabriq.toml — every key optional; the values shown are the defaults
//! device = "auto"            # "auto" (an active RDMA NIC, else shm0, else tcp0), or a device name
//! workers = 1                # run-to-completion worker threads
//! pin_workers = false        # pin worker i to CPU i
//! idle_spin_us = 50          # busy-poll this long after the last work, then sleep
//! rpc_timeout_ms = 5000      # default deadline of Rpc::call_default
//! handshake_timeout_ms = 5000
//! link_speed_gbps = 0        # picks thresholds: 25 → 2K/32K, 100 → 4K/64K, 200 → 8K/128K; 0 = device's
//! rx_slots = 64              # receive ring per channel (the peer's credits)
//! sq_depth = 128
//! max_queued = 64            # messages queued for credit before send blocks
//! max_message_len = 4294967296
//! # eager_max = 4096         # override the profile's eager threshold
//! # chunk_size = 65536       # override the profile's READ chunk
//! reads_in_flight = 4
//! rnr_retry = 7              # QP RNR retries (the credit scheme never needs one; 0 makes any
//!                            # RNR a hard error)
//! ```
//!
//! Environment: `FABRIQ_DEVICE`, `FABRIQ_WORKERS`, `FABRIQ_PIN_WORKERS`, `FABRIQ_IDLE_SPIN_US`,
//! `FABRIQ_RPC_TIMEOUT_MS`, `FABRIQ_HANDSHAKE_TIMEOUT_MS`, `FABRIQ_LINK_SPEED_GBPS`,
//! `FABRIQ_RX_SLOTS`, `FABRIQ_SQ_DEPTH`, `FABRIQ_MAX_QUEUED`, `FABRIQ_MAX_MESSAGE_LEN`,
//! `FABRIQ_EAGER_MAX`, `FABRIQ_CHUNK_SIZE`, `FABRIQ_READS_IN_FLIGHT`, `FABRIQ_RNR_RETRY`; `FABRIQ_CONFIG` names a
//! TOML file read by [`Config::from_env`].

use std::path::Path;
use std::time::Duration;

use crate::channel::proto::ChannelConfig;
use crate::channel::wire::HEADER_LEN;
use crate::channel::Thresholds;

/// Errors reading a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown keys.
    #[error("parsing configuration: {0}")]
    Toml(#[from] toml::de::Error),
    /// An environment variable holds no valid value.
    #[error("environment variable {name}={value:?}: {why}")]
    Env {
        /// Variable.
        name: String,
        /// Value.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// Values that do not fit together.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Endpoint configuration. See the [module docs](self) for the file format.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `auto`, or a device name (`shm0`, `tcp0`, …).
    pub device: String,
    /// Worker threads.
    pub workers: usize,
    /// Pin worker `i` to CPU `i`.
    pub pin_workers: bool,
    /// Busy-poll budget after the last piece of work, microseconds.
    pub idle_spin_us: u64,
    /// Default RPC deadline, milliseconds.
    pub rpc_timeout_ms: u64,
    /// Connection handshake timeout, milliseconds.
    pub handshake_timeout_ms: u64,
    /// Link speed for the threshold profile (0: ask the device).
    pub link_speed_gbps: u32,
    /// Receive slots per channel.
    pub rx_slots: u32,
    /// Send-queue depth used by the channel protocol.
    pub sq_depth: u32,
    /// Messages queued waiting for credit before `send` blocks.
    pub max_queued: u32,
    /// Largest message.
    pub max_message_len: u64,
    /// Eager threshold override.
    pub eager_max: Option<u32>,
    /// READ chunk override.
    pub chunk_size: Option<u32>,
    /// READs in flight per channel.
    pub reads_in_flight: u32,
    /// RNR retry count of every QP (0..=7, 7 = forever).
    pub rnr_retry: u8,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            device: "auto".into(),
            workers: 1,
            pin_workers: false,
            idle_spin_us: 50,
            rpc_timeout_ms: 5000,
            handshake_timeout_ms: 5000,
            link_speed_gbps: 0,
            rx_slots: 64,
            sq_depth: 128,
            max_queued: 64,
            max_message_len: 4 << 30,
            eager_max: None,
            chunk_size: None,
            reads_in_flight: 4,
            rnr_retry: 7,
        }
    }
}

impl Config {
    /// Parse TOML text.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text)?;
        c.validate()?;
        Ok(c)
    }

    /// Read a TOML file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Config, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Config::from_toml_str(&text)
    }

    /// Defaults, then the file named by `FABRIQ_CONFIG` if set, then `FABRIQ_*` variables.
    pub fn from_env() -> Result<Config, ConfigError> {
        let base = match std::env::var("FABRIQ_CONFIG") {
            Ok(path) if !path.is_empty() => Config::from_file(path)?,
            _ => Config::default(),
        };
        base.with_env_vars(|k| std::env::var(k).ok())
    }

    /// Apply `FABRIQ_*` overrides looked up through `get` (testable without touching the
    /// process environment).
    pub fn with_env_vars(
        mut self,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        fn parse<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, ConfigError>
        where
            T::Err: std::fmt::Display,
        {
            v.trim().parse::<T>().map_err(|e| ConfigError::Env {
                name: name.into(),
                value: v.into(),
                why: e.to_string(),
            })
        }
        fn parse_bool(name: &str, v: &str) -> Result<bool, ConfigError> {
            match v.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => Ok(true),
                "0" | "false" | "no" | "off" => Ok(false),
                _ => Err(ConfigError::Env {
                    name: name.into(),
                    value: v.into(),
                    why: "expected true/false".into(),
                }),
            }
        }
        macro_rules! var {
            ($name:literal, $field:expr, $conv:expr) => {
                if let Some(v) = get($name) {
                    $field = $conv($name, &v)?;
                }
            };
        }
        if let Some(v) = get("FABRIQ_DEVICE") {
            self.device = v;
        }
        var!("FABRIQ_WORKERS", self.workers, parse);
        var!("FABRIQ_PIN_WORKERS", self.pin_workers, parse_bool);
        var!("FABRIQ_IDLE_SPIN_US", self.idle_spin_us, parse);
        var!("FABRIQ_RPC_TIMEOUT_MS", self.rpc_timeout_ms, parse);
        var!(
            "FABRIQ_HANDSHAKE_TIMEOUT_MS",
            self.handshake_timeout_ms,
            parse
        );
        var!("FABRIQ_LINK_SPEED_GBPS", self.link_speed_gbps, parse);
        var!("FABRIQ_RX_SLOTS", self.rx_slots, parse);
        var!("FABRIQ_SQ_DEPTH", self.sq_depth, parse);
        var!("FABRIQ_MAX_QUEUED", self.max_queued, parse);
        var!("FABRIQ_MAX_MESSAGE_LEN", self.max_message_len, parse);
        var!("FABRIQ_READS_IN_FLIGHT", self.reads_in_flight, parse);
        var!("FABRIQ_RNR_RETRY", self.rnr_retry, parse);
        if let Some(v) = get("FABRIQ_EAGER_MAX") {
            self.eager_max = Some(parse("FABRIQ_EAGER_MAX", &v)?);
        }
        if let Some(v) = get("FABRIQ_CHUNK_SIZE") {
            self.chunk_size = Some(parse("FABRIQ_CHUNK_SIZE", &v)?);
        }
        self.validate()?;
        Ok(self)
    }

    /// Check ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.into()));
        if self.workers == 0 || self.workers > 256 {
            return bad("workers must be in 1..=256");
        }
        if self.rnr_retry > 7 {
            return bad("rnr_retry must be in 0..=7");
        }
        if self.device.is_empty() {
            return bad("device is empty");
        }
        self.channel_config(0)
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))
    }

    /// The RPC default deadline.
    pub fn rpc_timeout(&self) -> Duration {
        Duration::from_millis(self.rpc_timeout_ms)
    }

    /// The handshake timeout.
    pub fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.handshake_timeout_ms.max(1))
    }

    /// The idle spin budget.
    pub fn idle_spin(&self) -> Duration {
        Duration::from_micros(self.idle_spin_us)
    }

    /// Thresholds for a device of `device_gbps` (used when `link_speed_gbps` is 0).
    pub fn thresholds(&self, device_gbps: u32) -> Thresholds {
        let speed = if self.link_speed_gbps > 0 {
            self.link_speed_gbps
        } else {
            device_gbps
        };
        let mut t = Thresholds::for_link_speed(speed);
        if let Some(e) = self.eager_max {
            t.eager_max = e;
        }
        if let Some(c) = self.chunk_size {
            t.chunk_size = c;
        }
        t.reads_in_flight = self.reads_in_flight;
        t
    }

    /// The channel protocol settings for a device of `device_gbps`. Receive slots hold the
    /// largest eager payload of any profile (8 KiB) or the configured eager maximum, whichever
    /// is larger, so thresholds can be raised on a live channel.
    pub fn channel_config(&self, device_gbps: u32) -> ChannelConfig {
        let thresholds = self.thresholds(device_gbps);
        let eager_room = thresholds.eager_max.max(8 << 10);
        ChannelConfig {
            rx_slots: self.rx_slots,
            rx_slot_size: eager_room.saturating_add(HEADER_LEN as u32),
            sq_depth: self.sq_depth,
            thresholds,
            ack_delay: Duration::from_micros(50),
            max_queued: self.max_queued,
            max_pulls: 4,
            max_message_len: self.max_message_len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_round_trip_and_unknown_keys_refused() {
        let c = Config::from_toml_str("device = \"tcp0\"\nworkers = 2\neager_max = 1024\n")
            .expect("valid");
        assert_eq!(c.device, "tcp0");
        assert_eq!(c.workers, 2);
        assert_eq!(c.thresholds(100).eager_max, 1024);
        let text = toml::to_string(&c).expect("serialises");
        assert_eq!(Config::from_toml_str(&text).expect("parses"), c);
        assert!(matches!(
            Config::from_toml_str("wokers = 2"),
            Err(ConfigError::Toml(_))
        ));
    }

    #[test]
    fn env_overrides_and_rejects_garbage() {
        let c = Config::default()
            .with_env_vars(|k| match k {
                "FABRIQ_WORKERS" => Some("3".into()),
                "FABRIQ_LINK_SPEED_GBPS" => Some("25".into()),
                "FABRIQ_PIN_WORKERS" => Some("yes".into()),
                _ => None,
            })
            .expect("valid");
        assert_eq!(c.workers, 3);
        assert!(c.pin_workers);
        assert_eq!(c.thresholds(100).eager_max, 2048);
        let err =
            Config::default().with_env_vars(|k| (k == "FABRIQ_RX_SLOTS").then(|| "lots".into()));
        assert!(matches!(err, Err(ConfigError::Env { .. })));
        let err = Config::default().with_env_vars(|k| (k == "FABRIQ_WORKERS").then(|| "0".into()));
        assert!(matches!(err, Err(ConfigError::Invalid(_))));
    }
}
