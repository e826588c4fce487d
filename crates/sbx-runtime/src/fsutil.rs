//! File-tree helpers for images.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Shifts the owner of every file under `root` by `base` (uid u -> base + u), without following
/// links, so that a user namespace mapping 0 to `base` sees the tree's own owners. Keeps the
/// set-user and set-group bits, which chown clears.
pub fn shift_owners(root: &Path, base: u32) -> io::Result<u64> {
    let mut count = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path)?;
        if meta.uid() < base {
            std::os::unix::fs::lchown(&path, Some(meta.uid() + base), Some(meta.gid() + base))?;
            if !meta.file_type().is_symlink() && meta.mode() & 0o6000 != 0 {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(
                    &path,
                    std::fs::Permissions::from_mode(meta.mode() & 0o7777),
                )?;
            }
            count += 1;
        }
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                stack.push(entry?.path());
            }
        }
    }
    Ok(count)
}
