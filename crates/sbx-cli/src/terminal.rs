//! `sbx exec -it`: an interactive terminal in a sandbox, over the node's WebSocket
//! (`…/exec/{exec_id}/terminal`); `sbx exec -i` without a terminal sends stdin through
//! `…/stdin` while the output streams.

use std::io::{Read, Write};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::bail;
use sbx_api::ExecRequest;
use sbx_client::TerminalEvent;

use crate::{command_of, Cli};

struct RawMode(bool);

impl RawMode {
    fn on() -> RawMode {
        RawMode(crossterm::terminal::enable_raw_mode().is_ok())
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if self.0 {
            let _ = crossterm::terminal::disable_raw_mode();
        }
    }
}

/// Runs `command` in `sandbox` with stdin attached; on a terminal when `tty`.
pub fn run(cli: &Cli, sandbox: &str, command: &[String], tty: bool) -> anyhow::Result<u8> {
    if !tty {
        return piped(cli, sandbox, command);
    }
    let client = cli.client();
    let (cols, rows) = crossterm::terminal::size().unwrap_or((80, 24));
    let mut r = ExecRequest::new(command_of(command));
    (r.tty, r.rows, r.cols) = (true, rows, cols);
    let obj = client.exec(sandbox, &r)?;
    let mut term = client
        .terminal(sandbox, &obj.id, 0)
        .map_err(|e| anyhow::anyhow!("open the terminal: {e}"))?;
    term.set_read_timeout(Some(Duration::from_millis(20)))?;
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdin.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let raw = RawMode::on();
    let mut out = std::io::stdout();
    let mut size = (cols, rows);
    let code = loop {
        match term.read() {
            Ok(TerminalEvent::Output(b)) => {
                out.write_all(&b)?;
                out.flush()?;
            }
            Ok(TerminalEvent::Exit(e)) => {
                break e.exit_code.map_or(125, i64::from).clamp(0, 255) as u8;
            }
            Ok(TerminalEvent::Closed) => break 125,
            Ok(TerminalEvent::Idle) => {}
            Err(e) => {
                drop(raw);
                bail!("the terminal: {e}");
            }
        }
        while let Ok(b) = rx.try_recv() {
            term.send_input(&b)?;
        }
        if let Ok(now) = crossterm::terminal::size() {
            if now != size {
                size = now;
                term.resize(now.1, now.0)?;
            }
        }
    };
    drop(raw);
    term.close();
    Ok(code)
}

/// `sbx exec -i` without a terminal: stdin goes through `…/stdin` calls, in order, then closes.
fn piped(cli: &Cli, sandbox: &str, command: &[String]) -> anyhow::Result<u8> {
    let client = cli.client();
    let mut r = ExecRequest::new(command_of(command));
    r.stdin_open = true;
    let exec_id = client.exec(sandbox, &r)?.id;
    let (sb, id) = (sandbox.to_string(), exec_id.clone());
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = client.write_stdin(&sb, &id, &[], true);
                    return;
                }
                Ok(n) => {
                    if client.write_stdin(&sb, &id, &buf[..n], false).is_err() {
                        return;
                    }
                }
            }
        }
    });
    crate::sandboxes::follow_output(cli, sandbox, &exec_id)
}
