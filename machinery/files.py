"""Files on disks the program does not own: every output created fresh and renamed into place, appends only to
regular files, and reads only of regular files, so that a link, FIFO or device planted in a run folder or an
image folder can neither redirect a write nor block a read.

    with files.created(path) as f:   # a temporary name made with O_CREAT|O_EXCL beside `path`, written,
        torch.save(obj, f)            # flushed to disk, then renamed over `path` (a link there is replaced,
                                      # never followed); on any error the temporary file is removed
    files.append_line(path, text)     # one os.write of a whole line to a regular file (never through a link)
    with files.open_regular(path) as f: ...   # refuses anything but a regular file, without blocking on it
    with files.open_regular(path, follow=False) as f: ...   # and a link there too: a file this program wrote
    files.fresh_folder(parent, "session-")   # a new folder of a name nobody could guess, made here (mkdir)
    files.own_folder(path)            # a folder the program names itself: made here, never a planted link
    files.own_or_named(path, default) # a cache folder: own_folder when it is the default, else the user's
    files.check_space([(path, bytes)], advice)  # refuse, before writing, what the free disk cannot hold

OS errors (a full disk, a read-only folder, no permission) become one UserError line naming the file and the
reason; `kept` says what was left as it was.
"""
import contextlib
import errno
import os
import shutil
import stat
import zipfile

import numpy as np

from machinery.errors import RUN_STOPPED, UserError


def os_error(e, path, kept=""):
    """One UserError line for an OSError on `path`: what failed, why, and what was kept."""
    reason = e.strerror or errno.errorcode.get(e.errno, str(e))
    return UserError(f"could not write {path} ({reason})" + (f"; {kept}" if kept else ""), RUN_STOPPED)


def fresh_temp(path):
    """An empty file beside `path` that this call created (O_CREAT|O_EXCL: never an existing file or link),
    for writers that take a file name (FFCV); finish with `commit(tmp, path)`, or remove it."""
    folder, name = os.path.split(os.path.abspath(path))
    for _ in range(100):
        tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", path)


def commit(tmp, path):
    """fsync `tmp`, then rename it over `path`: a symlink at `path` is replaced, not followed."""
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if os.path.isdir(path) and not os.path.islink(path):
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    os.replace(tmp, path)


def is_regular(path):
    """True for a regular file at `path` itself (a link there is not one)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


@contextlib.contextmanager
def created(path, mode="wb", kept="", previous=None):
    """Open a fresh temporary file for writing; on leaving without error it replaces `path` whole (and with
    `previous`, a regular file at `path` is first renamed to it). An OSError (or a writer's own error for a
    full disk, e.g. torch's RuntimeError) removes the temporary file, leaves `path` as it was, and is raised
    as one UserError line ending in `kept`."""
    tmp = None
    try:
        tmp = fresh_temp(path)
        with open(tmp, mode) as f:
            yield f
        if previous and is_regular(path):
            os.replace(path, previous)
        commit(tmp, path)
        tmp = None
    except OSError as e:
        raise os_error(e, path, kept) from None
    except RuntimeError as e:  # torch.save and safetensors report write failures this way
        if "write" not in str(e).lower() and "disk" not in str(e).lower() and "space" not in str(e).lower():
            raise
        raise os_error(OSError(errno.EIO, str(e).strip().splitlines()[0]), path, kept) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def append_line(path, text, kept=""):
    """Append `text` + newline as one write to `path`, which must be a regular file (created if missing);
    a link, FIFO or device there is refused. Whole lines only: a reader never sees half of this one unless the
    disk fills mid-write, and then the error is one UserError line."""
    data = (text.rstrip("\n") + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{path} is a symbolic link; only files this program made are written to: "
                            "remove it") from None
        raise os_error(e, path, kept) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{path} is not a regular file; this run writes only files it owns: remove it")
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(errno.ENOSPC, "No space left on device", path)
    except OSError as e:
        raise os_error(e, path, kept) from None
    finally:
        os.close(fd)


def open_regular(path, mode="rb", follow=True):
    """open(path, mode) for reading, but only for a regular file (links resolved once; with follow=False a
    link is refused too: a file the program wrote itself, a cache, is never one); a FIFO, device or folder
    raises OSError at once instead of blocking."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def kind(path):
    """What is at path, in words, for an error line: 'no such file', 'a FIFO', 'a folder', ..."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "no such file"
    kinds = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    for test, name in kinds:
        if test(mode):
            return name
    return "not a regular file"


def own_folder(path):
    """A folder this program names itself (a shard folder, a cache, a tracker's): made here, or where it is
    already, a real directory of this user's; a link (even to a folder), a file or another user's folder
    there is one UserError line, and nothing is written or deleted through it. The folders above it are the
    user's: made if missing, and they may be links. -> path."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    except OSError as e:
        raise os_error(e, path) from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder"
        raise UserError(f"{path} is {what}; this program uses only folders it made there: remove it")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise UserError(f"{path} belongs to another user; this program uses only folders it made: remove it, "
                        "or choose another place")
    return path


def fresh_folder(parent, prefix):
    """A new folder in `parent`, named `prefix` and random hex, made here by mkdir (which fails on anything
    already there): no name inside it can have been planted beforehand, for writers whose files have names
    anyone could guess (a tracker's). -> its path."""
    for _ in range(100):
        path = os.path.join(parent, prefix + os.urandom(6).hex())
        try:
            os.mkdir(path, 0o755)
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise os_error(e, path) from None
    raise UserError(f"no free folder name in {parent}")


def own_or_named(folder, default):
    """A cache folder: the program's default one is its own (own_folder: never a planted link); one the user
    named may be anything, links included (runs on another disk), and is made if missing. -> folder."""
    if os.path.normpath(folder) == os.path.normpath(default):
        return own_folder(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise os_error(e, folder) from None
    return folder


def write_npz(path, shape, chunks):
    """arr_0: uint8 images `shape` (N, H, W, C), streamed from `chunks` ((images, labels) in index order:
    one chunk in memory at a time), and arr_1: the labels, as np.savez lays them out (uncompressed .npy
    entries) but with fixed timestamps, so the same images give the same bytes."""
    def entry(name):
        info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type, info.external_attr = zipfile.ZIP_STORED, 0o644 << 16
        return info

    labels, count = [], 0
    with created(path, kept="the shards are kept: run the same command again") as f:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open(entry("arr_0.npy"), "w", force_zip64=True) as out:
                np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(np.dtype(
                    np.uint8)), "fortran_order": False, "shape": tuple(shape)})
                for images, y in chunks:
                    out.write(memoryview(np.ascontiguousarray(images, np.uint8)).cast("B"))
                    labels.append(np.asarray(y, np.int64))
                    count += len(images)
            if count != shape[0]:
                raise UserError(f"{count} images in the shards, {shape[0]} expected")
            with zf.open(entry("arr_1.npy"), "w", force_zip64=True) as out:
                np.lib.format.write_array(out, np.concatenate(labels), allow_pickle=False)


def check_space(needs, advice):
    """Refuse in one UserError line, before anything is written, what the free disk cannot hold: needs is
    [(path, bytes)] (a path not there yet: its nearest folder, on the same disk); empty paths are skipped."""
    per_disk = {}
    for where, size in needs:
        if where:
            where = os.path.abspath(where)
            while not os.path.isdir(where):
                where = os.path.dirname(where)
            folder, total = per_disk.get(os.stat(where).st_dev, (where, 0))
            per_disk[os.stat(where).st_dev] = (folder, total + size)
    for folder, size in per_disk.values():
        free = shutil.disk_usage(folder).free
        if size > free:
            unit, scale = ("GiB", 2**30) if size >= 2**30 else ("MiB", 2**20)
            raise UserError(f"this needs about {size / scale:.1f} {unit} in {folder} and {free / scale:.1f} "
                            f"{unit} are free: {advice}")
