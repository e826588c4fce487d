//! `sbx exec -it`: an interactive terminal in a sandbox.

use anyhow::bail;

use crate::Cli;

pub fn run(_cli: &Cli, _sandbox: &str, _command: &[String], _tty: bool) -> anyhow::Result<u8> {
    bail!("terminals (sbx exec -it) are not served by this node yet")
}
