//! The preview host's form, shared by a node's preview listener (`sbx-preview`) and the
//! control plane's (which passes a request on to the node that has the sandbox).

/// `{port}-{sandbox}.{domain}[:port]` -> (port, sandbox id or name); `None` for any other host.
pub fn parse_host(host: &str, domain: &str) -> Option<(u16, String)> {
    let host = host.trim().to_ascii_lowercase();
    let name = match host.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => h,
        Some(_) => return None,
        None => host.as_str(),
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    let label = name.strip_suffix(domain)?.strip_suffix('.')?;
    if label.contains('.') {
        return None;
    }
    let (port, sandbox) = label.split_once('-')?;
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port: u16 = port.parse().ok().filter(|p| *p > 0)?;
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    if sandbox.is_empty() || !sandbox.chars().all(valid) {
        return None;
    }
    Some((port, sandbox.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preview_hosts() {
        let p = |h: &str| parse_host(h, "localhost");
        assert_eq!(p("8080-sbx-abc.localhost"), Some((8080, "sbx-abc".into())));
        assert_eq!(
            p("8080-SBX-abc.LOCALHOST:7780"),
            Some((8080, "sbx-abc".into()))
        );
        assert_eq!(p("3000-my-app.localhost."), Some((3000, "my-app".into())));
        assert_eq!(
            parse_host("1-x.preview.example.com:443", "preview.example.com"),
            Some((1, "x".into()))
        );
        for bad in [
            "localhost",
            "sbx-abc.localhost",
            "8080.localhost",
            "8080-.localhost",
            "0-sbx-a.localhost",
            "65536-sbx-a.localhost",
            "+80-sbx-a.localhost",
            "8080-sbx-a.evil.localhost",
            "8080-sbx-a.localhostx",
            "8080-sbx-a.xlocalhost",
            "8080-sbx-a.localhost:x",
            "8080-sbx a.localhost",
            "[::1]:7780",
            "127.0.0.1:7780",
        ] {
            assert_eq!(p(bad), None, "{bad}");
        }
    }
}
