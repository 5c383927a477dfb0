//! Shared helpers of the integration tests: the skip/fail rule for service variables, a
//! byte-level scripted [`TurnPolicy`], and a child-process openenv-core server.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use composer_env::{TurnEnd, TurnOutput, TurnPolicy};

/// Reads a service variable. Unset: fails when `CI` is set, else prints a loud SKIPPED line.
pub fn service_var(name: &str, test: &str) -> Option<String> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => Some(v),
        _ => {
            let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false");
            assert!(
                !ci,
                "{test}: {name} is unset but CI is set (start the server with ../shared/openenv/start-server.sh)"
            );
            eprintln!("SKIPPED: {test}: {name} is unset (start ../shared/openenv/start-server.sh and export {name})");
            None
        }
    }
}

/// Turn bookkeeping shared by concurrent policies: calls in flight now and at most.
#[derive(Default)]
pub struct Gauge {
    now: AtomicUsize,
    /// Highest number of concurrent `generate_turn` calls seen.
    pub max: AtomicUsize,
}

/// A policy that "samples" scripted messages as UTF-8 bytes (token id = byte), with made-up
/// log-probs `-(k + 1) / 100` so tests can check they are kept exactly.
pub struct ScriptedPolicy {
    /// Messages, one per turn (cycled).
    pub messages: Vec<String>,
    /// Turns generated so far.
    pub turn: usize,
    /// Pretend generation time.
    pub delay: Duration,
    /// Concurrency gauge.
    pub gauge: Option<Arc<Gauge>>,
}

impl ScriptedPolicy {
    /// A policy saying `messages` in turn, instantly.
    pub fn new(messages: &[&str]) -> Self {
        ScriptedPolicy {
            messages: messages.iter().map(|m| m.to_string()).collect(),
            turn: 0,
            delay: Duration::ZERO,
            gauge: None,
        }
    }

    /// The log-prob the policy reports for its `k`-th token of a turn.
    pub fn logprob(k: usize) -> f32 {
        -((k + 1) as f32) / 100.0
    }
}

#[async_trait]
impl TurnPolicy for ScriptedPolicy {
    async fn generate_turn(
        &mut self,
        _context_ids: &[u32],
        max_new_tokens: usize,
    ) -> anyhow::Result<TurnOutput> {
        if let Some(g) = &self.gauge {
            let now = g.now.fetch_add(1, Ordering::SeqCst) + 1;
            g.max.fetch_max(now, Ordering::SeqCst);
        }
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        if let Some(g) = &self.gauge {
            g.now.fetch_sub(1, Ordering::SeqCst);
        }
        let text = &self.messages[self.turn % self.messages.len()];
        self.turn += 1;
        let ids: Vec<u32> = text.bytes().map(u32::from).take(max_new_tokens).collect();
        Ok(TurnOutput {
            sampler_logprobs: (0..ids.len()).map(Self::logprob).collect(),
            token_ids: ids,
            policy_version: 7,
            finish_reason: TurnEnd::Stop,
        })
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// A free TCP port on 127.0.0.1 (bound then released).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binding an ephemeral port");
    l.local_addr().expect("local addr").port()
}

/// A real openenv-core echo server run as a child process from the venv that
/// start-server.sh made (`$OPENENV_VENV`), with its own session cap. The same command as
/// start-server.sh, without its pid file, so tests can stop, pause and restart it.
pub struct PyServer {
    child: Option<Child>,
    venv: PathBuf,
    /// Listen port.
    pub port: u16,
    max_sessions: usize,
    extra_args: Vec<String>,
    log: PathBuf,
    /// `(directory, module)` of a custom app served instead of the echo env.
    app: Option<(PathBuf, String)>,
}

impl PyServer {
    /// Starts a server on `port` (not waiting for health).
    pub fn spawn(venv: &Path, port: u16, max_sessions: usize, log_dir: &Path) -> PyServer {
        Self::spawn_with(venv, port, max_sessions, log_dir, &[])
    }

    /// Starts a server with extra uvicorn arguments (e.g. `--ws-ping-interval 0.5`).
    pub fn spawn_with(
        venv: &Path,
        port: u16,
        max_sessions: usize,
        log_dir: &Path,
        extra_args: &[&str],
    ) -> PyServer {
        let mut s = PyServer {
            child: None,
            venv: venv.to_path_buf(),
            port,
            max_sessions,
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            log: log_dir.join(format!("openenv-{port}.log")),
            app: None,
        };
        s.start();
        s
    }

    /// Starts a server on a free port running the ASGI app `module:app` of this crate's
    /// `tests/fixtures/` with the venv's openenv package (e.g. an MCP tool env), instead of
    /// the echo env.
    pub fn spawn_app(venv: &Path, log_dir: &Path, module: &str) -> PyServer {
        let app_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let port = free_port();
        let mut s = PyServer {
            child: None,
            venv: venv.to_path_buf(),
            port,
            max_sessions: 1,
            extra_args: Vec::new(),
            log: log_dir.join(format!("openenv-{port}.log")),
            app: Some((app_dir, module.to_string())),
        };
        s.start();
        s
    }

    /// (Re)starts the process.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "server already running");
        let (env_dir, module) = match &self.app {
            Some((dir, module)) => (dir.clone(), module.clone()),
            None => (
                self.venv.join("envs/echo_env"),
                "openenv_test_app".to_string(),
            ),
        };
        assert!(
            env_dir.join(format!("{module}.py")).is_file(),
            "{} has no {module}.py: run start-server.sh once with this venv",
            env_dir.display()
        );
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("opening the server log");
        let child = Command::new(self.venv.join("bin/python"))
            .args(["-m", "uvicorn", &format!("{module}:app"), "--app-dir"])
            .arg(&env_dir)
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--timeout-graceful-shutdown", "2"])
            .args(&self.extra_args)
            .current_dir(&env_dir)
            .env("OPENENV_MAX_SESSIONS", self.max_sessions.to_string())
            .env("ENABLE_WEB_INTERFACE", "false")
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .expect("starting uvicorn from $OPENENV_VENV");
        self.child = Some(child);
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Polls `GET /health` until it answers (panics after 120 s with the log's tail).
    pub async fn wait_healthy(&mut self) {
        let url = format!("{}/health", self.url());
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .expect("http client");
        let start = Instant::now();
        loop {
            if let Ok(r) = http.get(&url).send().await {
                if r.status().is_success() {
                    return;
                }
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    panic!(
                        "openenv server exited ({status}); log:\n{}",
                        self.log_tail()
                    );
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "openenv server not healthy after 120 s; log:\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn pid(&self) -> nix::unistd::Pid {
        let c = self.child.as_ref().expect("server not running");
        nix::unistd::Pid::from_raw(c.id() as i32)
    }

    /// SIGKILL and wait for the exit: the server dies at once, open connections and all
    /// (a crash, unlike [`PyServer::stop`]'s graceful shutdown, which may wait for them).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM (open WebSockets get close code 1012) and wait for the exit.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(c.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP: the server stops answering (calls time out) but keeps its sockets.
    pub fn pause(&self) {
        nix::sys::signal::kill(self.pid(), nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    }

    /// SIGCONT after [`PyServer::pause`].
    pub fn resume(&self) {
        nix::sys::signal::kill(self.pid(), nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    }

    /// The last lines of the server log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for PyServer {
    fn drop(&mut self) {
        self.stop();
    }
}
