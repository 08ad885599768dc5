//! `device = "auto"` with a peer on another host: a server in its own network namespace (its
//! own network stack, reached over a veth pair, as another machine would be) is reached on
//! `tcp0` by an auto client, while the same client reaches a listener at its own veth address
//! on `shm0`. Both ends report the device their channel runs on.
//!
//! Needs root and iproute2 (`ip netns`, veth); elsewhere it prints SKIP and passes. The server
//! is this test binary run as `ip netns exec <ns> <binary> --exact <test>` in a helper role,
//! selected by an environment variable. Only the namespaces' own addresses are used.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fabriq::{Config, Endpoint, Progress};

const ROLE_ENV: &str = "FABRIQ_AUTO_REMOTE_SERVER";
const HANG: Duration = Duration::from_secs(30);
const NS: &str = "fqauto";
const HOST_IF: &str = "fqauto-h";
const NS_IF: &str = "fqauto-n";
const HOST_IP: &str = "10.250.77.1";
const NS_IP: &str = "10.250.77.2";

fn endpoint() -> Endpoint {
    Endpoint::new(Config {
        device: "auto".into(),
        progress: Progress::Caller,
        ..Config::default()
    })
    .expect("auto endpoint")
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespace and veth pair, removed on drop.
struct Net;

impl Net {
    fn up() -> Result<Net, String> {
        // A leftover of an interrupted run goes first.
        let _ = ip(&["netns", "del", NS]);
        let _ = ip(&["link", "del", HOST_IF]);
        ip(&["netns", "add", NS])?;
        let net = Net;
        ip(&[
            "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF,
        ])?;
        ip(&["link", "set", NS_IF, "netns", NS])?;
        ip(&["addr", "add", &format!("{HOST_IP}/30"), "dev", HOST_IF])?;
        ip(&["link", "set", HOST_IF, "up"])?;
        let ns = |args: &[&str]| {
            let mut a = vec!["netns", "exec", NS, "ip"];
            a.extend_from_slice(args);
            ip(&a)
        };
        ns(&["addr", "add", &format!("{NS_IP}/30"), "dev", NS_IF])?;
        ns(&["link", "set", NS_IF, "up"])?;
        ns(&["link", "set", "lo", "up"])?;
        Ok(net)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", NS]);
        let _ = ip(&["link", "del", HOST_IF]);
    }
}

/// Helper role (in the namespace): listen on the namespace's address, print it, echo every
/// message of the first channel back, then print the channel's device.
fn serve() {
    let ep = endpoint();
    let l = ep.listen(format!("{NS_IP}:0")).expect("listen");
    println!("LISTEN {}", l.local_addr());
    std::io::stdout().flush().expect("flush");
    let ch = l.accept_timeout(HANG).expect("accept");
    for _ in 0..4 {
        let m = ch.recv_timeout(HANG).expect("recv");
        ch.send(&m).expect("echo");
    }
    println!("DEVICE {}", ch.device());
    std::io::stdout().flush().expect("flush");
    // Wait for the client to hang up.
    let _ = ch.recv_timeout(Duration::from_secs(5));
}

fn spawn_server() -> (Child, BufReader<std::process::ChildStdout>, String) {
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new("ip")
        .args(["netns", "exec", NS])
        .arg(exe)
        .args([
            "--exact",
            "auto_reaches_a_peer_on_another_host_over_tcp",
            "--nocapture",
        ])
        .env(ROLE_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the server in the namespace");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    let addr = loop {
        line.clear();
        if out.read_line(&mut line).expect("read server") == 0 {
            panic!("server exited before listening");
        }
        if let Some(a) = line.trim().strip_prefix("LISTEN ") {
            break a.to_string();
        }
    };
    (child, out, addr)
}

#[test]
fn auto_reaches_a_peer_on_another_host_over_tcp() {
    if std::env::var_os(ROLE_ENV).is_some() {
        return serve();
    }
    let _net = match Net::up() {
        Ok(n) => n,
        Err(why) => {
            println!("SKIP auto with a remote peer: cannot make a network namespace ({why})");
            return;
        }
    };
    let client = endpoint();
    if client.devices() != ["shm0", "tcp0"] {
        println!("SKIP: auto opened {:?}", client.devices());
        return;
    }

    // The peer in the namespace is not on this host: tcp0, on both ends.
    let (mut child, mut out, addr) = spawn_server();
    let c = client
        .connect(addr.as_str())
        .expect("connect to the namespace");
    assert_eq!(c.device(), "tcp0");
    for len in [8usize, 4000, 70_000, 1 << 20] {
        let msg: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        c.send(&msg).expect("send");
        assert_eq!(&c.recv_timeout(HANG).expect("echo")[..], &msg[..]);
    }
    let mut line = String::new();
    let device = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).expect("read server") > 0,
            "server gone"
        );
        if let Some(d) = line.trim().strip_prefix("DEVICE ") {
            break d.to_string();
        }
    };
    assert_eq!(device, "tcp0", "the server's end of the channel");
    drop(c);
    let status = child.wait().expect("server exit");
    assert!(status.success(), "server: {status}");

    // A listener at this host's own veth address is on this host: shm0.
    let local = endpoint();
    let l = local
        .listen(format!("{HOST_IP}:0"))
        .expect("listen on the veth address");
    let c = client.connect(l.local_addr()).expect("connect locally");
    let s = l.accept_timeout(HANG).expect("accept");
    assert_eq!((c.device(), s.device()), ("shm0", "shm0"));
    c.send(b"local").expect("send");
    assert_eq!(&s.recv_timeout(HANG).expect("recv")[..], b"local");
}
