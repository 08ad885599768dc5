//! `fabriq info`: what `ibv_devinfo` and `ucx_info -d` are to their stacks.
//!
//! Lists every device of every built-in provider ([`fabriq_verbs::devices`]), opens each one and
//! prints its [`DeviceAttr`] and the attributes of every port. A device that cannot be opened is
//! shown with the error instead of its attributes; the listing goes on. This module only reads:
//! it creates no PD, CQ or QP.

use std::fmt::Write as _;

use crate::out::{out, outln};
use anyhow::Context as _;
use fabriq_verbs::{Context, DeviceAttr, DeviceInfo, PortAttr};
use serde::Serialize;

/// Show RDMA devices, their attributes and ports (like ibv_devinfo).
#[derive(Debug, clap::Args)]
#[command(about = "Show RDMA devices, their attributes and ports (like ibv_devinfo)")]
pub struct Args {
    /// Machine-readable JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Show only this device (it is opened even if discovery does not list it).
    #[arg(short = 'd', long = "device", value_name = "DEVICE")]
    pub device: Option<String>,
}

/// The full report, as printed by `--json`.
#[derive(Debug, Serialize)]
pub struct InfoReport {
    /// Names of the providers built into this binary.
    pub providers: Vec<&'static str>,
    /// One entry per device.
    pub devices: Vec<DeviceReport>,
}

/// One device: its discovery entry and, if it opened, attributes and ports.
#[derive(Debug, Serialize)]
pub struct DeviceReport {
    /// Device name.
    pub name: String,
    /// Provider serving it.
    pub provider: String,
    /// Link kind.
    pub transport: String,
    /// Node GUID, hex.
    pub guid: String,
    /// Human description.
    pub description: String,
    /// Attributes, when the device opened.
    pub attr: Option<DeviceAttr>,
    /// Port attributes, when the device opened; a port that failed to answer holds an error.
    pub ports: Vec<PortReport>,
    /// Why the device could not be opened.
    pub error: Option<String>,
}

/// One port, or the error querying it.
#[derive(Debug, Serialize)]
pub struct PortReport {
    /// 1-based port number.
    pub port_num: u8,
    /// Attributes, when the query succeeded.
    pub attr: Option<PortAttr>,
    /// Why the query failed.
    pub error: Option<String>,
}

/// Entry point of `fabriq info`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let report = collect(args.device.as_deref())?;
    let failed_selected = args.device.is_some() && report.devices.iter().any(|d| d.error.is_some());
    if args.json {
        let text = serde_json::to_string_pretty(&report).context("encode JSON")?;
        outln!("{text}")?;
    } else {
        out!("{}", render_text(&report))?;
    }
    if failed_selected {
        anyhow::bail!(
            "device {} could not be opened",
            args.device.unwrap_or_default()
        );
    }
    Ok(())
}

/// Discover and open devices (all, or only `only`).
pub fn collect(only: Option<&str>) -> anyhow::Result<InfoReport> {
    let providers = fabriq_verbs::provider::providers()
        .iter()
        .map(|p| p.name())
        .collect();
    let mut listed = fabriq_verbs::devices().context("device discovery")?;
    if let Some(name) = only {
        listed.retain(|d| d.name == name);
        if listed.is_empty() {
            // Not discovered: open it anyway, so the user sees why it is missing.
            let entry = match Context::open(name) {
                Ok(ctx) => describe(ctx.device().clone(), Ok(ctx)),
                Err(err) => DeviceReport {
                    name: name.to_string(),
                    provider: String::new(),
                    transport: String::new(),
                    guid: String::new(),
                    description: String::new(),
                    attr: None,
                    ports: Vec::new(),
                    error: Some(err.to_string()),
                },
            };
            return Ok(InfoReport {
                providers,
                devices: vec![entry],
            });
        }
    }
    let devices = listed
        .into_iter()
        .map(|info| {
            let opened = Context::open(&info.name);
            describe(info, opened)
        })
        .collect();
    Ok(InfoReport { providers, devices })
}

fn describe(info: DeviceInfo, opened: fabriq_verbs::Result<Context>) -> DeviceReport {
    let mut entry = DeviceReport {
        name: info.name,
        provider: info.provider,
        transport: format!("{:?}", info.transport),
        guid: format!("{:#018x}", info.guid),
        description: info.description,
        attr: None,
        ports: Vec::new(),
        error: None,
    };
    match opened {
        Ok(ctx) => {
            let attr = ctx.query_device();
            entry.ports = (1..=attr.phys_port_cnt)
                .map(|port_num| match ctx.query_port(port_num) {
                    Ok(p) => PortReport {
                        port_num,
                        attr: Some(p),
                        error: None,
                    },
                    Err(err) => PortReport {
                        port_num,
                        attr: None,
                        error: Some(err.to_string()),
                    },
                })
                .collect();
            entry.attr = Some(attr);
        }
        Err(err) => entry.error = Some(err.to_string()),
    }
    entry
}

/// The `ibv_devinfo -v`-like text form.
pub fn render_text(report: &InfoReport) -> String {
    let mut out = String::new();
    if report.devices.is_empty() {
        let _ = writeln!(
            out,
            "No devices found (providers built in: {}).",
            report.providers.join(", ")
        );
        return out;
    }
    for (i, d) in report.devices.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let _ = writeln!(out, "hca_id: {}", d.name);
        row(&mut out, 1, "provider", &d.provider);
        row(&mut out, 1, "transport", &d.transport);
        row(&mut out, 1, "node_guid", &d.guid);
        row(&mut out, 1, "description", &d.description);
        if let Some(err) = &d.error {
            row(&mut out, 1, "error", &format!("cannot open: {err}"));
            continue;
        }
        if let Some(a) = &d.attr {
            row(&mut out, 1, "fw_ver", &a.fw_ver);
            row(&mut out, 1, "vendor_id", &format!("{:#x}", a.vendor_id));
            row(&mut out, 1, "vendor_part_id", &a.vendor_part_id.to_string());
            row(&mut out, 1, "hw_ver", &format!("{:#x}", a.hw_ver));
            row(&mut out, 1, "max_mr_size", &format!("{:#x}", a.max_mr_size));
            row(
                &mut out,
                1,
                "page_size_cap",
                &format!("{:#x}", a.page_size_cap),
            );
            row(&mut out, 1, "max_qp", &a.max_qp.to_string());
            row(&mut out, 1, "max_qp_wr", &a.max_qp_wr.to_string());
            row(&mut out, 1, "max_sge", &a.max_sge.to_string());
            row(&mut out, 1, "max_cq", &a.max_cq.to_string());
            row(&mut out, 1, "max_cqe", &a.max_cqe.to_string());
            row(&mut out, 1, "max_mr", &a.max_mr.to_string());
            row(&mut out, 1, "max_pd", &a.max_pd.to_string());
            row(&mut out, 1, "max_qp_rd_atom", &a.max_qp_rd_atom.to_string());
            row(
                &mut out,
                1,
                "max_qp_init_rd_atom",
                &a.max_qp_init_rd_atom.to_string(),
            );
            row(&mut out, 1, "max_srq", &a.max_srq.to_string());
            row(&mut out, 1, "max_srq_wr", &a.max_srq_wr.to_string());
            row(
                &mut out,
                1,
                "max_inline_data",
                &a.max_inline_data.to_string(),
            );
            row(&mut out, 1, "atomic_cap", &format!("{:?}", a.atomic_cap));
            row(&mut out, 1, "phys_port_cnt", &a.phys_port_cnt.to_string());
            row(&mut out, 1, "capabilities", &capability_names(a));
        }
        for p in &d.ports {
            let _ = writeln!(out, "\t\tport:\t{}", p.port_num);
            match (&p.attr, &p.error) {
                (Some(pa), _) => {
                    row(&mut out, 3, "state", &format!("{:?}", pa.state));
                    row(&mut out, 3, "max_mtu", &pa.max_mtu.to_string());
                    row(&mut out, 3, "active_mtu", &pa.active_mtu.to_string());
                    row(&mut out, 3, "link_layer", &pa.link_layer);
                    row(&mut out, 3, "address", &pa.address);
                    row(&mut out, 3, "lid", &pa.lid.to_string());
                    row(&mut out, 3, "gid", &format_gid(&pa.gid));
                    let speed = if pa.speed_gbps == 0 {
                        "unknown".to_string()
                    } else {
                        format!("{} Gb/s", pa.speed_gbps)
                    };
                    row(&mut out, 3, "speed", &speed);
                }
                (None, Some(err)) => row(&mut out, 3, "error", err),
                (None, None) => {}
            }
        }
    }
    out
}

fn row(out: &mut String, indent: usize, key: &str, value: &str) {
    let _ = writeln!(out, "{}{key:<22}{value}", "\t".repeat(indent));
}

fn capability_names(a: &DeviceAttr) -> String {
    let names: Vec<&str> = a.capabilities.iter_names().map(|(n, _)| n).collect();
    if names.is_empty() {
        "(none)".to_string()
    } else {
        names.join(" | ")
    }
}

fn format_gid(gid: &[u8; 16]) -> String {
    gid.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabriq_verbs::{AtomicCap, Capabilities, PortState};

    fn attr() -> DeviceAttr {
        DeviceAttr {
            fw_ver: "1.0".into(),
            vendor_id: 0,
            vendor_part_id: 0,
            hw_ver: 0,
            max_mr_size: 1 << 30,
            page_size_cap: 4096,
            max_qp: 1024,
            max_qp_wr: 4096,
            max_sge: 8,
            max_cq: 1024,
            max_cqe: 65536,
            max_mr: 4096,
            max_pd: 64,
            max_qp_init_rd_atom: 16,
            max_qp_rd_atom: 16,
            max_srq: 0,
            max_srq_wr: 0,
            max_inline_data: 256,
            atomic_cap: AtomicCap::Global,
            phys_port_cnt: 1,
            capabilities: Capabilities::SEND | Capabilities::WRITE,
        }
    }

    fn sample() -> InfoReport {
        InfoReport {
            providers: vec!["shm", "tcp"],
            devices: vec![
                DeviceReport {
                    name: "shm0".into(),
                    provider: "shm".into(),
                    transport: "SharedMemory".into(),
                    guid: "0x0000000000000001".into(),
                    description: "shared memory".into(),
                    attr: Some(attr()),
                    ports: vec![PortReport {
                        port_num: 1,
                        attr: Some(PortAttr {
                            port_num: 1,
                            state: PortState::Active,
                            max_mtu: 4096,
                            active_mtu: 4096,
                            link_layer: "shared-memory".into(),
                            lid: 0,
                            gid: [0; 16],
                            address: "host".into(),
                            speed_gbps: 0,
                        }),
                        error: None,
                    }],
                    error: None,
                },
                DeviceReport {
                    name: "tcp0".into(),
                    provider: "tcp".into(),
                    transport: "Tcp".into(),
                    guid: "0x0000000000000002".into(),
                    description: "tcp".into(),
                    attr: None,
                    ports: Vec::new(),
                    error: Some("bind refused".into()),
                },
            ],
        }
    }

    #[test]
    fn text_shows_attributes_ports_and_open_errors() {
        let text = render_text(&sample());
        assert!(text.contains("hca_id: shm0"));
        assert!(text.contains("max_qp_wr"));
        assert!(text.contains("SEND | WRITE"));
        assert!(text.contains("Active"));
        assert!(text.contains("shared-memory"));
        assert!(text.contains("hca_id: tcp0"));
        assert!(text.contains("cannot open: bind refused"));
    }

    #[test]
    fn json_nests_attributes_and_errors() {
        let v = serde_json::to_value(sample()).expect("serialise");
        assert_eq!(v["devices"][0]["ports"][0]["attr"]["state"], "Active");
        assert_eq!(v["devices"][0]["attr"]["max_inline_data"], 256);
        assert_eq!(v["devices"][1]["error"], "bind refused");
        assert!(v["devices"][1]["attr"].is_null());
    }

    #[test]
    fn empty_listing_names_providers() {
        let text = render_text(&InfoReport {
            providers: vec!["shm"],
            devices: Vec::new(),
        });
        assert!(text.contains("No devices found"));
        assert!(text.contains("shm"));
    }
}
