"""E2B's Python SDK against an sbx node: what an envd of 0.6.4 serves of files. File metadata
(`user.e2b.*` extended attributes: written, read back by stat, list and rename, cleared by an
overwrite, set out of band), a symlink as envd describes it, watch events with their entry and
an overwrite seen as a write, signed download and upload URLs of a secured sandbox. Run by
crates/sandboxd/tests/it/e2b.rs; prints one line per check and exits non-zero at the first
that fails."""

import json
import sys
import time
import urllib.error
import urllib.request

from e2b import FileType, FilesystemEventType, Sandbox
from e2b.sandbox.filesystem.filesystem import WriteEntry


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def http(url, data=None, headers=None):
    req = urllib.request.Request(url, data=data, headers=headers or {})
    if data is not None:
        req.method = "POST"
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


s = Sandbox.create(timeout=120)
try:
    check("envd is 0.6.4", str(s._envd_version) == "0.6.4", str(s._envd_version))

    # Metadata: written with the file, read back by stat, list and rename.
    meta = {"author": "mish", "purpose": "upload"}
    w = s.files.write("m/a.txt", "x", metadata=meta)
    check("write answers its metadata", w.metadata == meta, str(w.metadata))
    check("stat reads it back", s.files.get_info("m/a.txt").metadata == meta)
    w = s.files.write("m/b.txt", "y", metadata={"k": "v"}, use_octet_stream=True)
    check("an octet-stream write too", w.metadata == {"k": "v"}, str(w.metadata))
    infos = s.files.write_files(
        [WriteEntry(path="m/c.txt", data="1"), WriteEntry(path="m/d.txt", data="2")],
        metadata={"batch": "1"},
    )
    check(
        "every file of a multipart upload gets it",
        all(s.files.get_info(i.path).metadata == {"batch": "1"} for i in infos),
    )
    listed = {e.name: e.metadata for e in s.files.list("m")}
    check("list reads it", listed.get("a.txt") == meta, str(listed))
    r = s.files.rename("m/a.txt", "m/e.txt")
    check("rename keeps it", r.metadata == meta, str(r.metadata))
    attrs = s.commands.run("getfattr -d /home/user/m/e.txt 2>/dev/null || "
                           "python3 -c \"import os; p='/home/user/m/e.txt'; "
                           "print({k: os.getxattr(p, k) for k in os.listxattr(p)})\"").stdout
    check("it is the file's user.e2b.* attributes", "user.e2b.author" in attrs, attrs)
    w = s.files.write("m/e.txt", "again")
    check("an overwrite without metadata clears it", w.metadata is None, str(w.metadata))
    check("stat agrees", s.files.get_info("m/e.txt").metadata is None)
    check("the overwrite's bytes are there", s.files.read("m/e.txt") == "again")
    s.commands.run(
        "python3 -c \"import os; os.setxattr('/home/user/m/b.txt', 'user.e2b.extra', b'1')\""
    )
    got = s.files.get_info("m/b.txt").metadata
    check("an attribute set out of band is metadata", got == {"k": "v", "extra": "1"}, str(got))

    # A symlink: the type of what it resolves to, and that as an absolute path.
    s.commands.run("ln -s b.txt m/link && ln -s nowhere m/dangling", cwd="/home/user")
    link = s.files.get_info("m/link")
    check("a symlink to a file says file", link.type == FileType.FILE, str(link.type))
    check(
        "its target is absolute",
        link.symlink_target == "/home/user/m/b.txt",
        str(link.symlink_target),
    )
    d = s.files.get_info("m/dangling")
    check("a dangling one says symlink", d.type == FileType.SYMLINK, str(d.type))

    # Watch: an overwrite is a write of the file (not a rename over it), with its entry.
    h = s.files.watch_dir("m", include_entry=True)
    s.files.write("m/b.txt", "changed")
    ev = h.get_new_events()
    writes = [e for e in ev if e.type == FilesystemEventType.WRITE and e.name == "b.txt"]
    check("an overwrite is seen written", writes, str(ev))
    made = [e for e in ev if e.type in (FilesystemEventType.CREATE, FilesystemEventType.RENAME)]
    check("nothing is seen made or renamed over it", not made, str(ev))
    entry = writes[0].entry
    check(
        "the event has its entry",
        entry is not None and entry.path == "/home/user/m/b.txt" and entry.type == FileType.FILE,
        str(entry),
    )
    h.stop()
    h = s.files.watch_dir("m", allow_network_mounts=True)
    s.files.write("m/c.txt", "z")
    ev = h.get_new_events()
    check(
        "allow_network_mounts watches as before",
        any(e.type == FilesystemEventType.WRITE and e.name == "c.txt" for e in ev),
        str(ev),
    )
    h.stop()
finally:
    s.kill()

# Signed URLs of a secured sandbox: the URL alone reads or writes one file.
s = Sandbox.create(timeout=120, secure=True)
try:
    s.files.write("signed.txt", "secret bytes")
    url = s.download_url("signed.txt", "user")
    check("a signed URL carries a signature", "signature=v1_" in url, url)
    status, body = http(url)
    check("a signed download URL reads the file", status == 200 and body == "secret bytes",
          f"{status} {body}")
    status, body = http(s.download_url("signed.txt", "user", 120))
    check("one with an expiration too", status == 200 and body == "secret bytes", f"{status}")
    status, body = http(s.download_url("signed.txt", "user", use_signature_expiration=-120))
    check(
        "an expired one is refused",
        status == 401 and json.loads(body) == {"code": 401, "message": "signature is already expired"},
        f"{status} {body}",
    )
    status, body = http(url.replace("signed.txt", "other.txt"))
    check("a signature is for its path only", status == 401, f"{status} {body}")
    status, body = http(url.replace("signature=v1_", "signature=v1_x"))
    check("a wrong signature is refused", status == 401, f"{status} {body}")
    # Upload: a signed URL for writing, not reading.
    up = s.upload_url("up.txt", "user")
    boundary = "sbxboundary"
    form = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"up.txt\"\r\n"
        f"Content-Type: application/octet-stream\r\n\r\nuploaded\r\n--{boundary}--\r\n"
    ).encode()
    status, body = http(up, form, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    check("a signed upload URL writes the file", status == 200, f"{status} {body}")
    check("its bytes are there", s.files.read("up.txt") == "uploaded")
    status, body = http(up)
    check("a write signature does not read", status == 401, f"{status} {body}")
    status, body = http(url, form, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    check("a read signature does not write", status == 401, f"{status} {body}")
    base = url.split("/files")[0]
    status, body = http(f"{base}/files?path=signed.txt&username=user")
    check("no signature, no token: refused", status == 401, f"{status} {body}")
finally:
    s.kill()

print("all passed", flush=True)
