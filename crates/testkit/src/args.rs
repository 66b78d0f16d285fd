//! The command lines of the two roles, `leasehold controller` and `leasehold sidecar`, as the
//! tests and the benchmark start them: one builder per role holding the defaults they use,
//! with a method for each flag that varies. [`ControllerArgs::to_args`] and
//! [`SidecarArgs::to_args`] give the argument list (after the program name), which runs a
//! process, a container or anything else that takes one.

/// `leasehold controller` for one namespace: `--namespace NS --identity ID --metrics-addr
/// ADDR`, then whatever else was added.
#[derive(Clone, Debug)]
pub struct ControllerArgs {
    pub(crate) namespace: String,
    pub(crate) identity: String,
    pub(crate) metrics_addr: String,
    extra: Vec<String>,
}

impl ControllerArgs {
    /// The controller of `namespace`, identity `test-controller`, serving /metrics, /healthz
    /// and /readyz on a port of the kernel's choosing on loopback (`127.0.0.1:0`).
    pub fn new(namespace: &str) -> ControllerArgs {
        ControllerArgs {
            namespace: namespace.to_string(),
            identity: "test-controller".to_string(),
            metrics_addr: "127.0.0.1:0".to_string(),
            extra: Vec::new(),
        }
    }

    /// `--identity`: the name the controller writes as leader and in events.
    pub fn identity(mut self, identity: &str) -> ControllerArgs {
        self.identity = identity.to_string();
        self
    }

    /// `--metrics-addr`: where it serves /metrics, /healthz and /readyz.
    pub fn metrics_addr(mut self, addr: &str) -> ControllerArgs {
        self.metrics_addr = addr.to_string();
        self
    }

    /// `--leader-elect false` when `elect` is false (the default elects).
    pub fn leader_elect(self, elect: bool) -> ControllerArgs {
        if elect {
            self
        } else {
            self.args(["--leader-elect", "false"])
        }
    }

    /// `--events WHICH` (e.g. `all`).
    pub fn events(self, which: &str) -> ControllerArgs {
        self.args(["--events", which])
    }

    /// Further arguments, appended as given.
    pub fn args<S: AsRef<str>>(mut self, more: impl IntoIterator<Item = S>) -> ControllerArgs {
        self.extra
            .extend(more.into_iter().map(|s| s.as_ref().to_string()));
        self
    }

    /// The argument list, starting with `controller`.
    pub fn to_args(&self) -> Vec<String> {
        let mut args: Vec<String> = [
            "controller",
            "--namespace",
            &self.namespace,
            "--identity",
            &self.identity,
            "--metrics-addr",
            &self.metrics_addr,
        ]
        .map(String::from)
        .into();
        args.extend(self.extra.iter().cloned());
        args
    }
}

/// `leasehold sidecar` for one queue: `--queue Q --namespace NS --identity ID`, `--listen ADDR`
/// when set, then whatever else was added.
#[derive(Clone, Debug)]
pub struct SidecarArgs {
    pub(crate) namespace: String,
    queue: String,
    pub(crate) identity: String,
    listen: Option<String>,
    extra: Vec<String>,
}

impl SidecarArgs {
    /// A sidecar serving `queue` in `namespace` as `identity` (the holder it writes), on the
    /// sidecar's default address unless [`SidecarArgs::listen`] says otherwise.
    pub fn new(namespace: &str, queue: &str, identity: &str) -> SidecarArgs {
        SidecarArgs {
            namespace: namespace.to_string(),
            queue: queue.to_string(),
            identity: identity.to_string(),
            listen: None,
            extra: Vec::new(),
        }
    }

    /// `--listen ADDR`: where it serves the worker's API.
    pub fn listen(mut self, addr: &str) -> SidecarArgs {
        self.listen = Some(addr.to_string());
        self
    }

    /// `--metrics-addr ADDR`: a second listener for /metrics and the probes.
    pub fn metrics_addr(self, addr: &str) -> SidecarArgs {
        self.args(["--metrics-addr", addr])
    }

    /// `--worker-timeout SECS`: how long a silent worker keeps its jobs renewed.
    pub fn worker_timeout(self, secs: u64) -> SidecarArgs {
        self.args(["--worker-timeout".to_string(), secs.to_string()])
    }

    /// Further arguments, appended as given.
    pub fn args<S: AsRef<str>>(mut self, more: impl IntoIterator<Item = S>) -> SidecarArgs {
        self.extra
            .extend(more.into_iter().map(|s| s.as_ref().to_string()));
        self
    }

    /// The argument list, starting with `sidecar`.
    pub fn to_args(&self) -> Vec<String> {
        let mut args: Vec<String> = [
            "sidecar",
            "--queue",
            &self.queue,
            "--namespace",
            &self.namespace,
            "--identity",
            &self.identity,
        ]
        .map(String::from)
        .into();
        if let Some(listen) = &self.listen {
            args.extend(["--listen".to_string(), listen.clone()]);
        }
        args.extend(self.extra.iter().cloned());
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_defaults_and_flags_in_order() {
        let args = ControllerArgs::new("ns")
            .identity("c-0")
            .metrics_addr("127.0.0.1:9")
            .leader_elect(false)
            .events("all")
            .to_args();
        assert_eq!(
            args,
            [
                "controller",
                "--namespace",
                "ns",
                "--identity",
                "c-0",
                "--metrics-addr",
                "127.0.0.1:9",
                "--leader-elect",
                "false",
                "--events",
                "all"
            ]
        );
        assert_eq!(
            ControllerArgs::new("ns").leader_elect(true).to_args()[3..],
            [
                "--identity",
                "test-controller",
                "--metrics-addr",
                "127.0.0.1:0"
            ]
        );
    }

    #[test]
    fn sidecar_listen_only_when_set() {
        assert_eq!(
            SidecarArgs::new("ns", "q", "s").to_args(),
            [
                "sidecar",
                "--queue",
                "q",
                "--namespace",
                "ns",
                "--identity",
                "s"
            ]
        );
        assert_eq!(
            SidecarArgs::new("ns", "q", "s")
                .listen("127.0.0.1:1")
                .worker_timeout(3600)
                .to_args()[7..],
            ["--listen", "127.0.0.1:1", "--worker-timeout", "3600"]
        );
    }
}
