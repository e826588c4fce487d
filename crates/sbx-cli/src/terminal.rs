//! `sbx exec -it`: an interactive terminal in a sandbox, over the node's WebSocket
//! (`…/exec/{exec_id}/terminal`); `sbx exec -i` without a terminal sends stdin through
//! `…/stdin` while the output streams.

use std::io::{Read, Write};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use serde_json::{json, Value};
use tungstenite::client::IntoClientRequest;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::Message;

use crate::{agent, api_error, Cli};

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

fn post(cli: &Cli, path: &str, body: Value) -> anyhow::Result<Value> {
    let mut r = agent().post(&format!("{}{path}", cli.url.trim_end_matches('/')));
    if let Some(k) = &cli.api_key {
        r = r.set("authorization", &format!("Bearer {k}"));
    }
    Ok(r.send_json(body).map_err(api_error)?.into_json()?)
}

fn command_value(command: &[String]) -> Value {
    if command.len() == 1 {
        json!(command[0])
    } else {
        json!(command)
    }
}

/// Runs `command` in `sandbox` with stdin attached; on a terminal when `tty`.
pub fn run(cli: &Cli, sandbox: &str, command: &[String], tty: bool) -> anyhow::Result<u8> {
    if !tty {
        return piped(cli, sandbox, command);
    }
    let (cols, rows) = crossterm::terminal::size().unwrap_or((80, 24));
    let obj = post(
        cli,
        &format!("/v1/sandboxes/{sandbox}/exec"),
        json!({ "command": command_value(command), "tty": true, "rows": rows, "cols": cols }),
    )?;
    let exec_id = obj["id"].as_str().ok_or_else(|| anyhow!("no exec id"))?;
    let ws_url = format!(
        "{}/v1/sandboxes/{sandbox}/exec/{exec_id}/terminal",
        cli.url.trim_end_matches('/').replacen("http", "ws", 1)
    );
    let mut request = ws_url.as_str().into_client_request()?;
    if let Some(k) = &cli.api_key {
        request
            .headers_mut()
            .insert("authorization", format!("Bearer {k}").parse()?);
    }
    let (mut ws, _) = tungstenite::connect(request).context("open the terminal")?;
    if let MaybeTlsStream::Plain(s) = ws.get_mut() {
        s.set_read_timeout(Some(Duration::from_millis(20)))?;
    }
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
        match ws.read() {
            Ok(Message::Binary(b)) => {
                out.write_all(&b)?;
                out.flush()?;
            }
            Ok(Message::Text(t)) => {
                let v: Value = serde_json::from_str(t.as_str()).unwrap_or(Value::Null);
                if v["type"] == "exit" {
                    break v["exit_code"].as_i64().unwrap_or(125).clamp(0, 255) as u8;
                }
            }
            Ok(Message::Close(_)) => break 125,
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
                break 125
            }
            Err(e) => {
                drop(raw);
                bail!("the terminal: {e}");
            }
        }
        while let Ok(b) = rx.try_recv() {
            ws.send(Message::Binary(b.into()))?;
        }
        if let Ok(now) = crossterm::terminal::size() {
            if now != size {
                size = now;
                let resize = json!({ "type": "resize", "rows": now.1, "cols": now.0 });
                ws.send(Message::Text(resize.to_string().into()))?;
            }
        }
    };
    drop(raw);
    let _ = ws.close(None);
    Ok(code)
}

/// `sbx exec -i` without a terminal: stdin goes through `…/stdin` calls, in order, then closes.
fn piped(cli: &Cli, sandbox: &str, command: &[String]) -> anyhow::Result<u8> {
    let obj = post(
        cli,
        &format!("/v1/sandboxes/{sandbox}/exec"),
        json!({ "command": command_value(command), "stdin_open": true }),
    )?;
    let exec_id = obj["id"]
        .as_str()
        .ok_or_else(|| anyhow!("no exec id"))?
        .to_string();
    let (url, key, sb, id) = (
        cli.url.clone(),
        cli.api_key.clone(),
        sandbox.to_string(),
        exec_id.clone(),
    );
    std::thread::spawn(move || {
        let path = format!(
            "{}/v1/sandboxes/{sb}/exec/{id}/stdin",
            url.trim_end_matches('/')
        );
        let send = |data: &[u8], close: bool| {
            let mut r = agent().post(&path);
            if let Some(k) = &key {
                r = r.set("authorization", &format!("Bearer {k}"));
            }
            let body = json!({ "data": base64_std(data), "encoding": "base64", "close": close });
            r.send_json(body).is_ok()
        };
        let mut stdin = std::io::stdin();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => {
                    send(&[], true);
                    return;
                }
                Ok(n) => {
                    if !send(&buf[..n], false) {
                        return;
                    }
                }
            }
        }
    });
    crate::sandboxes::follow_output(cli, sandbox, &exec_id)
}

fn base64_std(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(data)
}
