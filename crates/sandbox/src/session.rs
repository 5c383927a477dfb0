//! A sandboxed command the caller talks to line by line ([`Sandbox::start`]): lines go to its
//! stdin, and it answers on its result channel (fd 3 inside), one line per message.
//!
//! Graders that keep a process alive across many requests use it (the repository grader runs
//! one candidate process per hidden test and forwards each call of the judge to it). Writes go
//! through a thread of their own, so a process that stops reading its stdin can never block
//! the caller; reads wait at most until a deadline the caller gives.

use std::io::Write;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::exec::{self, Running};
use crate::sandbox::Sandbox;
use crate::ExecResult;

/// A started command in a [`Sandbox`]; every process of it is killed by
/// [`Session::finish`] or when the session is dropped.
pub struct Session {
    running: Option<Running>,
    lines: mpsc::Receiver<Vec<u8>>,
    writer: Option<mpsc::Sender<Vec<u8>>>,
}

impl Sandbox {
    /// Starts `argv` (as [`Sandbox::run`]) with a result channel on fd 3 and returns the
    /// session to talk to it; it is killed at `timeout` at the latest.
    pub fn start(&self, argv: &[&str], timeout: Duration) -> Result<Session> {
        let cpu = self.limits().cpu_time_s;
        let mut running = match exec::spawn(
            self.dirs(),
            argv,
            self.limits(),
            timeout,
            cpu,
            true,
            exec::mode(),
        ) {
            Ok(r) => r,
            Err(e) => bail!("starting {:?} in the sandbox: {e}", argv.first()),
        };
        let Some(lines) = running.channel.take() else {
            bail!("the sandboxed command has no result channel");
        };
        let (tx, rx) = mpsc::channel::<Vec<u8>>();
        if let Some(mut stdin) = running.stdin.take() {
            std::thread::spawn(move || {
                for line in rx {
                    if stdin.write_all(&line).is_err() || stdin.flush().is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Session {
            running: Some(running),
            lines,
            writer: Some(tx),
        })
    }
}

impl Session {
    /// Queues `line` (a newline is added) for the command's stdin. False when the command's
    /// stdin is gone (the process ended or closed it).
    pub fn send_line(&self, line: &[u8]) -> bool {
        let mut data = line.to_vec();
        data.push(b'\n');
        self.writer.as_ref().is_some_and(|w| w.send(data).is_ok())
    }

    /// The next line the command wrote on its result channel (without the newline), waiting
    /// until `deadline`. None at the deadline, or when the channel is closed (the process
    /// ended, or closed fd 3).
    pub fn recv_line(&self, deadline: Instant) -> Option<Vec<u8>> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let mut line = self.lines.recv_timeout(wait).ok()?;
        if line.last() == Some(&b'\n') {
            line.pop();
        }
        Some(line)
    }

    /// Kills every process of the session and returns how it ended (its stdout and stderr,
    /// cut to the sandbox's output limit).
    pub fn finish(mut self) -> ExecResult {
        self.writer = None;
        let running = self.running.take().expect("a session is finished once");
        running.kill();
        crate::exec_result(running.finish())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(running) = self.running.take() {
            running.kill();
            let _ = running.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SandboxLimits;

    fn sandbox() -> Sandbox {
        Sandbox::new(SandboxLimits::default()).expect("sandbox")
    }

    const ECHO: &str = "import os, sys\n\
        for line in sys.stdin.buffer:\n\
        \x20   if line.strip() == b'quit':\n\
        \x20       break\n\
        \x20   os.write(3, b'got ' + line)\n";

    #[test]
    fn a_session_answers_line_by_line_and_dies_when_finished() {
        let sb = sandbox();
        let s = sb
            .start(&["python3", "-c", ECHO], Duration::from_secs(20))
            .unwrap();
        let deadline = || Instant::now() + Duration::from_secs(10);
        for i in 0..3 {
            assert!(s.send_line(format!("hello {i}").as_bytes()));
            assert_eq!(
                s.recv_line(deadline()).as_deref(),
                Some(format!("got hello {i}").as_bytes())
            );
        }
        assert!(s.send_line(b"quit"));
        // The channel closes when the process ends.
        assert_eq!(s.recv_line(deadline()), None);
        let r = s.finish();
        assert!(
            !matches!(r.outcome, crate::Outcome::SandboxError(_)),
            "{r:?}"
        );
    }

    #[test]
    fn a_silent_process_times_out_at_the_callers_deadline_and_is_killed() {
        let sb = sandbox();
        // Never reads stdin, never answers: sends and reads must not block.
        let s = sb
            .start(
                &["python3", "-c", "import time\nwhile True: time.sleep(1)"],
                Duration::from_secs(60),
            )
            .unwrap();
        let big = vec![b'x'; 1 << 20];
        for _ in 0..4 {
            s.send_line(&big);
        }
        let start = Instant::now();
        assert_eq!(
            s.recv_line(Instant::now() + Duration::from_millis(300)),
            None
        );
        let r = s.finish();
        assert!(start.elapsed() < Duration::from_secs(20), "{r:?}");
        assert_ne!(r.exit_code, Some(0));
    }
}
