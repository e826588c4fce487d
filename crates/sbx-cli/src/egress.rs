//! `sbx egress SANDBOX --allow pypi.org --deny '*'`: a sandbox's egress rules changed live
//! (`PATCH /v1/sandboxes/{id}` with the keys given; the others are kept).

use sbx_api::SandboxPatch;
use serde_json::{Map, Value};

use crate::{print_json, Cli};

#[derive(clap::Args, Debug)]
pub struct EgressArgs {
    /// The sandbox (id or name).
    sandbox: String,
    /// What holds where no rule speaks: allow or deny.
    #[arg(long, value_parser = ["allow", "deny"])]
    default: Option<String>,
    /// Allowed: an IP, a CIDR, a DNS name, *.name or * (repeatable; replaces `allow`).
    #[arg(long)]
    allow: Vec<String>,
    /// Refused, as --allow (repeatable; replaces `deny`).
    #[arg(long)]
    deny: Vec<String>,
    /// A port refused, TCP and UDP, whatever else holds (repeatable; replaces `deny_ports`).
    #[arg(long = "deny-port")]
    deny_ports: Vec<u16>,
    /// Remove every rule of the sandbox first.
    #[arg(long)]
    clear: bool,
    /// Print the sandbox object as JSON.
    #[arg(long)]
    json: bool,
}

/// The PATCH of `a`: the egress keys given, each null with --clear first. The node keeps a
/// sandbox's rules as the calls gave them (merged key by key), so the keys are the flags'
/// text as given.
fn patch(a: &EgressArgs) -> SandboxPatch {
    let mut e = Map::new();
    if a.clear {
        for k in ["default", "allow", "deny", "http", "inject", "deny_ports"] {
            e.insert(k.into(), Value::Null);
        }
    }
    if let Some(d) = &a.default {
        e.insert("default".into(), Value::from(d.as_str()));
    }
    if !a.allow.is_empty() {
        e.insert("allow".into(), Value::from(a.allow.clone()));
    }
    if !a.deny.is_empty() {
        e.insert("deny".into(), Value::from(a.deny.clone()));
    }
    if !a.deny_ports.is_empty() {
        e.insert("deny_ports".into(), Value::from(a.deny_ports.clone()));
    }
    SandboxPatch {
        egress: Some(Some(e)),
        ..SandboxPatch::default()
    }
}

pub fn egress(cli: &Cli, a: &EgressArgs) -> anyhow::Result<u8> {
    let obj = cli.client().patch_sandbox(&a.sandbox, &patch(a))?;
    if a.json {
        print_json(&obj)?;
    } else {
        println!("{}", serde_json::to_string(&obj.egress)?);
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use serde_json::json;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: EgressArgs,
    }

    #[test]
    fn flags_make_the_patch() {
        let t = T::parse_from([
            "t",
            "dev",
            "--allow",
            "pypi.org",
            "--deny",
            "*",
            "--deny-port",
            "25",
        ]);
        assert_eq!(
            patch(&t.a).to_json(),
            json!({"egress": {"allow": ["pypi.org"], "deny": ["*"], "deny_ports": [25]}})
        );
        let t = T::parse_from(["t", "dev", "--clear", "--default", "deny"]);
        assert_eq!(patch(&t.a).to_json()["egress"]["default"], "deny");
        assert_eq!(patch(&t.a).to_json()["egress"]["allow"], Value::Null);
    }
}
