//! The node's disk filesystem: where every sandbox's writable layer and every volume live, each
//! in a btrfs subvolume of its own with a hard size (a qgroup limit).
//!
//! Why btrfs: the host's disk here is ext4 without the `project`/`quota` features, and this
//! kernel has neither ext4's quota formats (`CONFIG_QFMT_V2` is off: an ext4 image made with
//! `-O project,quota` does not mount) nor XFS quotas (`CONFIG_XFS_QUOTA` is off); btrfs is
//! built in, and its qgroups give each subvolume a size of its own. A subvolume is made and
//! deleted by one ioctl each (no helper process on the request path), its limit set by one
//! more, and a deleted one is dropped by the kernel in the background.
//!
//! Made at node start, off the request path: `DATA_DIR/disk.img`, its blocks reserved on the
//! host's filesystem (fallocate: a sparse image whose host filesystem runs out under it fails
//! the sandboxes' writes with EIO; a reserved one fills up as a disk does, with ENOSPC), formatted
//! once with `mkfs.btrfs` (a helper process: no crate writes a btrfs), attached to a loop
//! device (LOOP_CTL_GET_FREE, LOOP_CONFIGURE with autoclear: the device goes when its last
//! mount does) and mounted at `DATA_DIR/disk` (nosuid, nodev); quotas are switched on by
//! ioctl (simple quotas where the kernel has them, else qgroups). A node that restarts finds
//! it mounted, or mounts it again (on the loop device that still holds the image, if one
//! does). When `DATA_DIR/disk` already is a btrfs (a mount of the operator's), it is used as
//! it is. An image made sparse by an older node has its blocks reserved at the next start; a
//! host without the room for them refuses the start ([`DiskError::NoRoom`]).

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("mkfs.btrfs: {0}")]
    Mkfs(String),
    /// The host's filesystem has not the room to reserve the image's blocks.
    #[error(
        "the node's disk {image} needs {needed} more bytes of the host's filesystem, which has \
         {free} free: {advice}"
    )]
    NoRoom {
        image: String,
        needed: u64,
        free: u64,
        advice: String,
    },
}

fn io_ctx(what: impl Into<String>) -> impl FnOnce(io::Error) -> DiskError {
    let what = what.into();
    move |source| DiskError::Io { what, source }
}

/// The image's name in the data directory, and the mount point's.
pub const IMAGE: &str = "disk.img";
pub const MOUNT: &str = "disk";

const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;
/// The inode number of a btrfs subvolume's root directory.
const SUBVOL_ROOT_INO: u64 = 256;

const BTRFS_IOCTL_MAGIC: u8 = 0x94;
const VOL_NAME_MAX: usize = 4087;
const SUBVOL_NAME_MAX: usize = 4039;
/// `BTRFS_SUBVOL_RDONLY`: the snapshot is made read-only.
const SUBVOL_RDONLY: u64 = 1 << 1;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const QUOTA_CTL_ENABLE: u64 = 1;
const QUOTA_CTL_ENABLE_SIMPLE: u64 = 4;
const QGROUP_LIMIT_MAX_RFER: u64 = 1;
const QUOTA_TREE_OBJECTID: u64 = 8;
const QGROUP_INFO_KEY: u32 = 242;

#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; VOL_NAME_MAX + 1],
}

/// `btrfs_ioctl_vol_args_v2`: a snapshot's source, flags and name.
#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; SUBVOL_NAME_MAX + 1],
}

#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

#[repr(C)]
struct QgroupCreateArgs {
    create: u64,
    qgroupid: u64,
}

#[repr(C)]
struct QgroupLimitArgs {
    qgroupid: u64,
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

#[repr(C)]
struct SearchKey {
    tree_id: u64,
    min_objectid: u64,
    max_objectid: u64,
    min_offset: u64,
    max_offset: u64,
    min_transid: u64,
    max_transid: u64,
    min_type: u32,
    max_type: u32,
    nr_items: u32,
    unused: u32,
    unused1: u64,
    unused2: u64,
    unused3: u64,
    unused4: u64,
}

#[repr(C)]
struct SearchArgs {
    key: SearchKey,
    buf: [u8; 4096 - std::mem::size_of::<SearchKey>()],
}

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// One ioctl whose argument is `arg` (a `repr(C)` struct of the kernel's layout for `request`).
fn ioctl_with<T>(fd: &impl AsRawFd, request: libc::c_ulong, arg: &mut T) -> io::Result<i32> {
    // SAFETY: `fd` is an open descriptor for the call; `arg` is a live, exclusively borrowed
    // struct whose layout is the one the kernel reads and writes for `request` (the callers
    // pair each request code with its struct, whose size is in the code).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg as *mut T) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn iow<T>(nr: u8) -> libc::c_ulong {
    nix::request_code_write!(BTRFS_IOCTL_MAGIC, nr, std::mem::size_of::<T>()) as libc::c_ulong
}
fn ior<T>(nr: u8) -> libc::c_ulong {
    nix::request_code_read!(BTRFS_IOCTL_MAGIC, nr, std::mem::size_of::<T>()) as libc::c_ulong
}
fn iowr<T>(nr: u8) -> libc::c_ulong {
    nix::request_code_readwrite!(BTRFS_IOCTL_MAGIC, nr, std::mem::size_of::<T>()) as libc::c_ulong
}

fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    Ok(fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?
        .into())
}

/// What the filesystem of `path` has free (0 when it cannot be read).
pub fn free_bytes(path: &Path) -> u64 {
    nix::sys::statvfs::statvfs(path)
        .map(|s| s.blocks_available() * s.fragment_size())
        .unwrap_or(0)
}

/// Whether `path` is on a btrfs.
pub fn is_btrfs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path).is_ok_and(|s| s.filesystem_type().0 == BTRFS_SUPER_MAGIC)
}

/// Whether `path` is the root of a btrfs subvolume.
pub fn is_subvolume(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir() && m.ino() == SUBVOL_ROOT_INO)
        && is_btrfs(path)
}

/// The node's disk filesystem (mounted; nothing is undone on drop: sandboxes that outlive the
/// node keep their layers on it). [`Disk::release`] takes the node's mounts of it away at its
/// stop (lazily: the loop device goes with the last use).
#[derive(Debug)]
pub struct Disk {
    root: PathBuf,
    /// Whether the node made the mount (an image of its own), so may take it away.
    own_mount: bool,
}

/// What the disk filesystem has, for `GET /internal/node`.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct DiskSpace {
    pub total_bytes: u64,
    pub free_bytes: u64,
}

impl Disk {
    /// The disk of the data directory `data_dir` (canonical): mounted if it is not, made (an
    /// image of `image_bytes`, its blocks reserved on the host) if there is none; an image of
    /// the node's whose blocks are not all reserved (made sparse) is reserved now. Blocking; a
    /// helper process the first time (mkfs.btrfs). [`DiskError::NoRoom`] when the host's
    /// filesystem has not the room for the image.
    pub fn open(data_dir: &Path, image_bytes: u64) -> Result<Disk, DiskError> {
        let root = data_dir.join(MOUNT);
        let image = data_dir.join(IMAGE);
        fs::create_dir_all(&root).map_err(io_ctx(format!("mkdir {}", root.display())))?;
        let own_mount = if is_btrfs(&root) {
            // Mounted already: by the node before a restart (the loop device of its image), or
            // by the operator.
            let own = root_is_image_mount(&root, &image);
            if own {
                reserve_image(&image)?;
            }
            own
        } else {
            if image.exists() {
                reserve_image(&image)?;
            } else {
                make_image(&image, image_bytes)?;
            }
            // An autoclear device goes at its last close: the descriptor is held until the
            // mount holds the device.
            let (dev, _held) = match loop_of(&image) {
                Some(dev) => (dev, None),
                None => {
                    let (dev, f) = attach_loop(&image)?;
                    (dev, Some(f))
                }
            };
            mount_btrfs(&dev, &root)?;
            true
        };
        let disk = Disk { root, own_mount };
        disk.enable_quota()?;
        for d in ["sandboxes", "volumes"] {
            let p = disk.root.join(d);
            fs::create_dir_all(&p).map_err(io_ctx(format!("mkdir {}", p.display())))?;
            fs::set_permissions(&p, fs::Permissions::from_mode(0o700))
                .map_err(io_ctx(format!("chmod {}", p.display())))?;
        }
        Ok(disk)
    }

    /// The mount point (`DATA_DIR/disk`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where sandboxes' directories live (bound at `DATA_DIR/sandboxes`).
    pub fn sandboxes(&self) -> PathBuf {
        self.root.join("sandboxes")
    }

    /// Where volumes live: `volumes/<vol-id>`.
    pub fn volumes(&self) -> PathBuf {
        self.root.join("volumes")
    }

    fn enable_quota(&self) -> Result<(), DiskError> {
        let fd = open_dir(&self.root).map_err(io_ctx("open the disk"))?;
        let mut args = QuotaCtlArgs {
            cmd: QUOTA_CTL_ENABLE_SIMPLE,
            status: 0,
        };
        if ioctl_with(&fd, iowr::<QuotaCtlArgs>(40), &mut args).is_ok() {
            return Ok(());
        }
        // A kernel before simple quotas (6.7): the full qgroups.
        let mut args = QuotaCtlArgs {
            cmd: QUOTA_CTL_ENABLE,
            status: 0,
        };
        ioctl_with(&fd, iowr::<QuotaCtlArgs>(40), &mut args)
            .map(drop)
            .map_err(io_ctx("enable quotas on the disk"))
    }

    /// Free and total bytes of the disk filesystem (total: the size of its device, metadata
    /// and the filesystem's own structures included).
    pub fn space(&self) -> DiskSpace {
        match nix::sys::statvfs::statvfs(&self.root) {
            Ok(s) => DiskSpace {
                total_bytes: s.blocks() * s.fragment_size(),
                free_bytes: s.blocks_available() * s.fragment_size(),
            },
            Err(_) => DiskSpace {
                total_bytes: 0,
                free_bytes: 0,
            },
        }
    }

    /// Takes the node's mounts of its image away (lazily: what still uses the filesystem keeps
    /// it, and the loop device goes with the last use): every mount of the image's loop device
    /// under the data directory, the disk's and the binds of it (`DATA_DIR/sandboxes`), a
    /// killed node's left over too (a node started after it finds them there and makes none
    /// of its own). For a node's stop.
    pub fn release(&self) {
        if !self.own_mount {
            return;
        }
        let data_dir = self.root.parent().unwrap_or(Path::new("/"));
        let mut points = loop_of(&data_dir.join(IMAGE))
            .and_then(|dev| {
                let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
                Some(mounts_of(&info, &dev, data_dir))
            })
            .unwrap_or_default();
        if points.is_empty() {
            points.push(self.root.clone());
        }
        // The last mounted first (one may be over another).
        for p in points.iter().rev() {
            let _ = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// Makes `path` (a new directory on a btrfs) a subvolume of at most `limit_bytes`, owned by
/// `owner` (uid = gid) with mode 0755 (a volume: the sandbox's root owns it) or 0700.
pub fn make_subvolume(path: &Path, limit_bytes: u64, owner: Option<u32>) -> io::Result<()> {
    let (parent, name) = split(path)?;
    let pfd = open_dir(parent)?;
    // SAFETY: VolArgs is plain old data (integers and bytes): all zeroes is a valid value.
    let mut args: VolArgs = unsafe { std::mem::zeroed() };
    args.name[..name.len()].copy_from_slice(name);
    ioctl_with(&pfd, iow::<VolArgs>(14), &mut args)?;
    let made = (|| {
        let fd = open_dir(path)?;
        set_limit_fd(&fd, limit_bytes)?;
        match owner {
            Some(uid) => {
                std::os::unix::fs::chown(path, Some(uid), Some(uid))?;
                fs::set_permissions(path, fs::Permissions::from_mode(0o755))
            }
            None => fs::set_permissions(path, fs::Permissions::from_mode(0o700)),
        }
    })();
    if let Err(e) = made {
        let _ = remove_subvolume(path);
        return Err(e);
    }
    Ok(())
}

/// Makes `dst` (a new name in a directory of the same btrfs) a read-only snapshot of the
/// subvolume at `src`: what `src` holds at this instant, which later writes to `src` do not
/// change (its extents are shared, nothing is copied). One ioctl; the kernel commits the
/// filesystem's transaction first, so what was written to `src` is in it. Removed with
/// [`remove_subvolume`].
pub fn snapshot_readonly(src: &Path, dst: &Path) -> io::Result<()> {
    let (parent, name) = split(dst)?;
    if name.len() > SUBVOL_NAME_MAX {
        return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    let sfd = open_dir(src)?;
    let pfd = open_dir(parent)?;
    // SAFETY: VolArgsV2 is plain old data (integers and bytes): all zeroes is a valid value.
    let mut args: VolArgsV2 = unsafe { std::mem::zeroed() };
    args.fd = i64::from(sfd.as_raw_fd());
    args.flags = SUBVOL_RDONLY;
    args.name[..name.len()].copy_from_slice(name);
    ioctl_with(&pfd, iow::<VolArgsV2>(23), &mut args).map(drop)
}

/// Sets the size of the subvolume at `path`.
pub fn set_limit(path: &Path, limit_bytes: u64) -> io::Result<()> {
    set_limit_fd(&open_dir(path)?, limit_bytes)
}

fn set_limit_fd(fd: &OwnedFd, limit_bytes: u64) -> io::Result<()> {
    // qgroupid 0: the subvolume the descriptor is in.
    let mut lim = QgroupLimitArgs {
        qgroupid: 0,
        flags: QGROUP_LIMIT_MAX_RFER,
        max_rfer: limit_bytes,
        max_excl: 0,
        rsv_rfer: 0,
        rsv_excl: 0,
    };
    ioctl_with(fd, ior::<QgroupLimitArgs>(43), &mut lim).map(drop)
}

/// The subvolume id of the subvolume `fd` is in.
fn subvolume_id(fd: &OwnedFd) -> io::Result<u64> {
    // SAFETY: InoLookupArgs is integers and bytes: all zeroes is a valid value.
    let mut args: InoLookupArgs = unsafe { std::mem::zeroed() };
    args.objectid = SUBVOL_ROOT_INO;
    ioctl_with(fd, iowr::<InoLookupArgs>(18), &mut args)?;
    Ok(args.treeid)
}

/// The bytes the subvolume at `path` holds (its qgroup's referenced bytes, as of the
/// filesystem's last commit).
pub fn used_bytes(path: &Path) -> io::Result<u64> {
    let fd = open_dir(path)?;
    let id = subvolume_id(&fd)?;
    // SAFETY: SearchArgs is integers and bytes: all zeroes is a valid value.
    let mut args: SearchArgs = unsafe { std::mem::zeroed() };
    args.key.tree_id = QUOTA_TREE_OBJECTID;
    args.key.min_objectid = 0;
    args.key.max_objectid = 0;
    args.key.min_type = QGROUP_INFO_KEY;
    args.key.max_type = QGROUP_INFO_KEY;
    args.key.min_offset = id;
    args.key.max_offset = id;
    args.key.max_transid = u64::MAX;
    args.key.nr_items = 1;
    ioctl_with(&fd, iowr::<SearchArgs>(17), &mut args)?;
    if args.key.nr_items == 0 {
        return Ok(0);
    }
    // A search header (transid, objectid, offset: u64; type, len: u32), then the item:
    // generation, rfer, ... (little-endian u64s).
    let item = &args.buf[32..];
    let mut rfer = [0u8; 8];
    rfer.copy_from_slice(&item[8..16]);
    Ok(u64::from_le_bytes(rfer))
}

/// Deletes the subvolume at `path` with everything in it (the kernel drops its tree in the
/// background), and its qgroup where the kernel lets it go at once.
pub fn remove_subvolume(path: &Path) -> io::Result<()> {
    let (parent, name) = split(path)?;
    let id = open_dir(path).and_then(|fd| subvolume_id(&fd)).ok();
    let pfd = open_dir(parent)?;
    // SAFETY: VolArgs is plain old data: all zeroes is a valid value.
    let mut args: VolArgs = unsafe { std::mem::zeroed() };
    args.name[..name.len()].copy_from_slice(name);
    ioctl_with(&pfd, iow::<VolArgs>(15), &mut args)?;
    if let Some(id) = id {
        // Refused (busy) while the kernel still counts bytes in it: then the empty qgroup
        // stays, an item of a few bytes.
        let mut q = QgroupCreateArgs {
            create: 0,
            qgroupid: id,
        };
        let _ = ioctl_with(&pfd, iow::<QgroupCreateArgs>(42), &mut q);
    }
    Ok(())
}

fn split(path: &Path) -> io::Result<(&Path, &[u8])> {
    let parent = path.parent().ok_or_else(|| io::Error::other("no parent"))?;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other("no name"))?
        .as_bytes();
    if name.len() > VOL_NAME_MAX {
        return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    Ok((parent, name))
}

/// Reserves every block of the file `f` (`len` bytes long) on its filesystem: holes are
/// allocated (as unwritten extents: nothing is written), what is there already is kept.
fn allocate(f: &fs::File, len: u64) -> io::Result<()> {
    let len = i64::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    nix::fcntl::fallocate(f, nix::fcntl::FallocateFlags::empty(), 0, len).map_err(io::Error::from)
}

/// What to tell an operator whose host has not the room for a new image of `bytes`.
fn smaller_image_advice(free: u64) -> String {
    format!(
        "start the node with a smaller --disk-image-bytes (at most {} here, and less to leave \
         the host room), or free room on the host's filesystem",
        free / 10 * 9
    )
}

fn no_room(image: &Path, needed: u64, advice: String) -> DiskError {
    let dir = image.parent().unwrap_or(Path::new("/"));
    DiskError::NoRoom {
        image: image.display().to_string(),
        needed,
        free: free_bytes(dir),
        advice,
    }
}

/// Reserves the blocks of an existing image (one an older node made sparse): a no-op when they
/// are all allocated already.
fn reserve_image(image: &Path) -> Result<(), DiskError> {
    let meta = fs::metadata(image).map_err(io_ctx(format!("stat {}", image.display())))?;
    let allocated = meta.blocks().saturating_mul(512);
    if allocated >= meta.len() {
        return Ok(());
    }
    let needed = meta.len() - allocated;
    let advice = || {
        format!(
            "free room on the host's filesystem, or remove {} (the sandboxes' layers and the \
             volumes on it go with it) and start the node with a --disk-image-bytes the host \
             has room for",
            image.display()
        )
    };
    // Checked first: a fallocate that runs out keeps what it allocated until then, and would
    // leave the host's filesystem full.
    if needed > free_bytes(image.parent().unwrap_or(Path::new("/"))) {
        return Err(no_room(image, needed, advice()));
    }
    let f = fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(image)
        .map_err(io_ctx(format!("open {}", image.display())))?;
    match allocate(&f, meta.len()) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => Err(no_room(image, needed, advice())),
        Err(e) => Err(io_ctx(format!("reserve the blocks of {}", image.display()))(e)),
    }
}

/// The image, its blocks reserved and formatted (under a temporary name, renamed once whole).
fn make_image(image: &Path, bytes: u64) -> Result<(), DiskError> {
    let tmp = image.with_extension("img.tmp");
    let _ = fs::remove_file(&tmp);
    // Checked first: a fallocate that runs out keeps what it allocated until then, and would
    // leave the host's filesystem full.
    let free = free_bytes(image.parent().unwrap_or(Path::new("/")));
    if bytes > free {
        return Err(no_room(image, bytes, smaller_image_advice(free)));
    }
    let f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io_ctx(format!("create {}", tmp.display())))?;
    if let Err(e) = allocate(&f, bytes) {
        drop(f);
        let _ = fs::remove_file(&tmp);
        return Err(match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EFBIG) => no_room(
                image,
                bytes,
                smaller_image_advice(free_bytes(image.parent().unwrap_or(Path::new("/")))),
            ),
            _ => io_ctx(format!("reserve {bytes} bytes for {}", tmp.display()))(e),
        });
    }
    drop(f);
    // -K: no discard (the reserved blocks are unwritten extents: they read as zeroes).
    let out = std::process::Command::new("mkfs.btrfs")
        .args(["-q", "-K", "-L", "sbx-disk"])
        .arg(&tmp)
        .output()
        .map_err(|e| DiskError::Mkfs(format!("start mkfs.btrfs (btrfs-progs): {e}")))?;
    if !out.status.success() {
        let _ = fs::remove_file(&tmp);
        return Err(DiskError::Mkfs(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    fs::rename(&tmp, image).map_err(io_ctx(format!("rename to {}", image.display())))
}

/// The loop device that has `image` attached, if one has (a previous node's, still held by
/// sandboxes' mounts).
fn loop_of(image: &Path) -> Option<PathBuf> {
    let meta = fs::metadata(image).ok()?;
    for e in fs::read_dir("/sys/block").ok()?.flatten() {
        let name = e.file_name();
        if !name.as_bytes().starts_with(b"loop") {
            continue;
        }
        // backing_file names the path; the device and inode are in the loop's sysfs too.
        let Ok(backing) = fs::read_to_string(e.path().join("loop/backing_file")) else {
            continue;
        };
        let backing = backing.trim_end();
        if fs::metadata(backing).is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino()) {
            return Some(Path::new("/dev").join(&name));
        }
    }
    None
}

/// Attaches `image` to a free loop device (autoclear); returns the device's path and an open
/// descriptor of it (the device is detached when the last one closes, unless mounted).
fn attach_loop(image: &Path) -> Result<(PathBuf, fs::File), DiskError> {
    let ctl = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/loop-control")
        .map_err(io_ctx("open /dev/loop-control"))?;
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(image)
        .map_err(io_ctx(format!("open {}", image.display())))?;
    // Another process may take the free device first: then the next one.
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and touches no memory of ours; `ctl` is
        // open for the call.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
        if n < 0 {
            return Err(DiskError::Io {
                what: "LOOP_CTL_GET_FREE".into(),
                source: io::Error::last_os_error(),
            });
        }
        let dev = PathBuf::from(format!("/dev/loop{n}"));
        let lo = match fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&dev)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // No node yet (devtmpfs makes it; a container's /dev may not).
                let dev_t = nix::sys::stat::makedev(7, n as u64);
                nix::sys::stat::mknod(
                    &dev,
                    nix::sys::stat::SFlag::S_IFBLK,
                    nix::sys::stat::Mode::from_bits_truncate(0o600),
                    dev_t,
                )
                .map_err(|e| DiskError::Io {
                    what: format!("mknod {}", dev.display()),
                    source: e.into(),
                })?;
                fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_CLOEXEC)
                    .open(&dev)
                    .map_err(io_ctx(format!("open {}", dev.display())))?
            }
            Err(e) => return Err(io_ctx(format!("open {}", dev.display()))(e)),
        };
        // SAFETY: LoopConfig is integers and bytes: all zeroes is a valid value.
        let mut cfg: LoopConfig = unsafe { std::mem::zeroed() };
        cfg.fd = file.as_raw_fd() as u32;
        cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR;
        let name = image.as_os_str().as_bytes();
        let n = name.len().min(63);
        cfg.info.lo_file_name[..n].copy_from_slice(&name[..n]);
        match ioctl_with(&lo, LOOP_CONFIGURE, &mut cfg) {
            Ok(_) => return Ok((dev, lo)),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => continue,
            Err(e) => return Err(io_ctx("LOOP_CONFIGURE")(e)),
        }
    }
    Err(DiskError::Io {
        what: "attach a loop device".into(),
        source: io::Error::from_raw_os_error(libc::EBUSY),
    })
}

fn mount_btrfs(dev: &Path, root: &Path) -> Result<(), DiskError> {
    use nix::mount::{mount, MsFlags};
    let dev_c = CString::new(dev.as_os_str().as_bytes()).map_err(|e| DiskError::Io {
        what: "device path".into(),
        source: io::Error::other(e),
    })?;
    mount(
        Some(dev_c.as_c_str()),
        root,
        Some("btrfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME,
        None::<&str>,
    )
    .map_err(|e| DiskError::Io {
        what: format!("mount {} at {}", dev.display(), root.display()),
        source: e.into(),
    })
}

/// A mount point as /proc/self/mountinfo writes it: space, tab, newline and backslash as
/// `\ooo` octal escapes.
fn unescape_mount_path(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// The mount points (in `mountinfo`'s order) of the filesystem of device `dev` under `dir`.
fn mounts_of(mountinfo: &str, dev: &Path, dir: &Path) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let point = unescape_mount_path(f.get(4)?);
            let source = f.iter().skip_while(|x| **x != "-").nth(2)?;
            (Path::new(source) == dev && point.starts_with(dir)).then_some(point)
        })
        .collect()
}

/// Whether the btrfs at `root` is the image's (its loop device's backing file is `image`).
fn root_is_image_mount(root: &Path, image: &Path) -> bool {
    let Some(dev) = loop_of(image) else {
        return false;
    };
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = root.to_string_lossy();
    info.lines().any(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        f.get(4) == Some(&want.as_ref())
            && f.iter()
                .skip_while(|x| **x != "-")
                .nth(2)
                .is_some_and(|src| Path::new(src) == dev)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_structs_have_the_kernels_sizes() {
        assert_eq!(std::mem::size_of::<VolArgs>(), 4096);
        assert_eq!(std::mem::size_of::<VolArgsV2>(), 4096);
        assert_eq!(std::mem::size_of::<InoLookupArgs>(), 4096);
        assert_eq!(std::mem::size_of::<SearchArgs>(), 4096);
        assert_eq!(std::mem::size_of::<SearchKey>(), 104);
        assert_eq!(std::mem::size_of::<QgroupLimitArgs>(), 48);
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
        // BTRFS_IOC_SUBVOL_CREATE and BTRFS_IOC_QGROUP_LIMIT as the kernel's headers give them.
        assert_eq!(iow::<VolArgs>(14), 0x5000_940e);
        assert_eq!(ior::<QgroupLimitArgs>(43), 0x8030_942b);
        // BTRFS_IOC_SNAP_CREATE_V2.
        assert_eq!(iow::<VolArgsV2>(23), 0x5000_9417);
    }

    /// A disk of its own (root, mkfs.btrfs): a subvolume's limit holds, its bytes are counted,
    /// and it goes with its files; a second open finds the disk mounted.
    #[test]
    fn a_subvolume_has_a_size() {
        if !nix::unistd::geteuid().is_root() || which("mkfs.btrfs").is_none() {
            eprintln!("skipped: needs root and mkfs.btrfs");
            return;
        }
        let data = std::env::temp_dir().join(format!("sbx-diskfs-{}", std::process::id()));
        let _ = fs::create_dir_all(&data);
        let disk = Disk::open(&data, 1 << 30).expect("disk");
        assert!(is_btrfs(disk.root()));
        let again = Disk::open(&data, 1 << 30).expect("found mounted");
        assert!(again.own_mount);
        let sub = disk.volumes().join("vol-a");
        make_subvolume(&sub, 8 << 20, Some(100_000)).expect("subvolume");
        assert!(is_subvolume(&sub));
        assert_eq!(fs::metadata(&sub).unwrap().uid(), 100_000);
        // A read-only snapshot keeps what the subvolume held; later writes do not reach it.
        fs::write(sub.join("kept"), b"before").unwrap();
        let snap = disk.root().join("snap-a");
        snapshot_readonly(&sub, &snap).expect("snapshot");
        assert!(is_subvolume(&snap));
        fs::write(sub.join("kept"), b"after").unwrap();
        assert_eq!(fs::read(snap.join("kept")).unwrap(), b"before");
        let denied = fs::write(snap.join("new"), b"x").expect_err("read-only");
        assert_eq!(denied.raw_os_error(), Some(libc::EROFS), "{denied}");
        remove_subvolume(&snap).expect("snapshot removed");
        assert!(!snap.exists());
        let mut f = fs::File::create(sub.join("big")).unwrap();
        let chunk = vec![7u8; 1 << 20];
        let mut err = None;
        for _ in 0..32 {
            if let Err(e) = io::Write::write_all(&mut f, &chunk).and_then(|_| f.sync_all()) {
                err = Some(e);
                break;
            }
        }
        let err = err.expect("the limit holds");
        assert_eq!(err.raw_os_error(), Some(libc::EDQUOT), "{err}");
        drop(f);
        nix::unistd::sync();
        let used = used_bytes(&sub).expect("used");
        assert!(((4 << 20)..=(9 << 20)).contains(&used), "{used}");
        remove_subvolume(&sub).expect("removed");
        assert!(!sub.exists());
        disk.release();
        assert!(!is_btrfs(&data.join(MOUNT)));
        let _ = fs::remove_dir_all(&data);
    }

    #[test]
    fn the_mounts_of_a_device_under_a_directory_are_found() {
        let info = "\
36 25 0:32 / /data/disk rw,noatime shared:1 - btrfs /dev/loop3 rw,space_cache=v2
37 25 0:32 /sandboxes /data/sandboxes rw,nosuid,nodev shared:1 - btrfs /dev/loop3 rw
38 25 0:33 / /other/disk rw shared:2 - btrfs /dev/loop4 rw
39 25 0:32 /sandboxes /elsewhere rw shared:1 - btrfs /dev/loop3 rw
40 25 0:32 / /data/a\\040b rw shared:1 - btrfs /dev/loop3 rw
";
        assert_eq!(
            mounts_of(info, Path::new("/dev/loop3"), Path::new("/data")),
            vec![
                PathBuf::from("/data/disk"),
                PathBuf::from("/data/sandboxes"),
                PathBuf::from("/data/a b"),
            ]
        );
        assert!(mounts_of(info, Path::new("/dev/loop5"), Path::new("/data")).is_empty());
    }

    /// An image made sparse (by an older node) has its blocks reserved; one larger than the
    /// host's free room is refused before anything is allocated.
    #[test]
    fn an_image_has_its_blocks_reserved() {
        let dir = std::env::temp_dir().join(format!("sbx-diskimg-{}", std::process::id()));
        let _ = fs::create_dir_all(&dir);
        let image = dir.join(IMAGE);
        let f = fs::File::create(&image).unwrap();
        f.set_len(16 << 20).unwrap();
        drop(f);
        assert!(fs::metadata(&image).unwrap().blocks() * 512 < 16 << 20);
        reserve_image(&image).expect("reserved");
        assert!(fs::metadata(&image).unwrap().blocks() * 512 >= 16 << 20);
        // Reserved already: nothing to do.
        reserve_image(&image).expect("reserved again");

        let huge = free_bytes(&dir) + (1 << 30);
        let f = fs::File::create(&image).unwrap();
        f.set_len(huge).unwrap();
        drop(f);
        let e = reserve_image(&image).unwrap_err();
        assert!(matches!(e, DiskError::NoRoom { .. }), "{e}");
        assert!(e.to_string().contains("--disk-image-bytes"), "{e}");
        assert!(fs::metadata(&image).unwrap().blocks() * 512 < 1 << 20);
        let e = make_image(&dir.join("other.img"), huge).unwrap_err();
        assert!(e.to_string().contains("smaller --disk-image-bytes"), "{e}");
        assert!(!dir.join("other.img.tmp").exists());
        let _ = fs::remove_dir_all(&dir);
    }

    fn which(name: &str) -> Option<PathBuf> {
        std::env::var_os("PATH")?
            .to_str()?
            .split(':')
            .map(|d| Path::new(d).join(name))
            .find(|p| p.exists())
    }
}
