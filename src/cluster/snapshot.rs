//! Snapshot files: what a cluster node keeps of its last snapshot, sends to a node that needs
//! one, and installs from, without ever holding a whole snapshot in memory (a store of millions
//! of messages makes a snapshot of gigabytes).
//!
//! A file is the magic `WRNS`, a version byte (1), then frames `len: u32 LE | crc32: u32 LE |
//! body`: the first frame is the postcard encoding of the `SnapshotMeta`, each next one a group
//! of ops (`op_codec::encode_ops`, as `Store::snapshot_to` streams them), and an empty frame
//! ends the file. A file that ends before that frame, or a frame whose checksum does not match,
//! is refused (a damaged or cut snapshot is never installed as if it were whole). The bytes of a
//! file travel as they are (`net`), so the receiver checks what the sender's disk had.

use super::types::SnapshotMeta;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use warren_storage::Op;

const MAGIC: &[u8; 5] = b"WRNS\x01";
/// A frame longer than this is damage, not data (groups are about a MiB; one message alone
/// is at most the broker's largest, well under this).
const MAX_FRAME: u32 = 1 << 30;

fn bad(path: &Path, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("snapshot file {}: {what}", path.display()),
    )
}

/// Writes a snapshot file: `create`, a `group` per group of ops, `finish`.
pub struct Writer {
    out: BufWriter<File>,
    path: PathBuf,
}

impl Writer {
    pub fn create(path: &Path, meta: &SnapshotMeta) -> io::Result<Writer> {
        let mut w = Writer {
            out: BufWriter::with_capacity(1 << 20, File::create(path)?),
            path: path.to_owned(),
        };
        w.out.write_all(MAGIC)?;
        let meta = postcard::to_stdvec(meta).map_err(io::Error::other)?;
        w.frame(&meta)?;
        Ok(w)
    }

    fn frame(&mut self, body: &[u8]) -> io::Result<()> {
        let len = u32::try_from(body.len())
            .ok()
            .filter(|l| *l <= MAX_FRAME)
            .ok_or_else(|| bad(&self.path, format!("a group of {} bytes", body.len())))?;
        self.out.write_all(&len.to_le_bytes())?;
        self.out.write_all(&crc32fast::hash(body).to_le_bytes())?;
        self.out.write_all(body)
    }

    pub fn group(&mut self, ops: &[Op]) -> io::Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let body = warren_storage::op_codec::encode_ops(ops).map_err(io::Error::other)?;
        self.frame(&body)
    }

    /// The end frame, then everything on disk (fsync).
    pub fn finish(mut self) -> io::Result<()> {
        self.out.write_all(&0u32.to_le_bytes())?;
        self.out.write_all(&0u32.to_le_bytes())?;
        let f = self.out.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()
    }
}

/// Reads a snapshot file from its start.
pub struct Reader {
    input: BufReader<File>,
    path: PathBuf,
    done: bool,
}

impl Reader {
    /// The file's meta, and a reader at its first group.
    pub fn open(file: File, path: &Path) -> io::Result<(SnapshotMeta, Reader)> {
        let mut r = Reader {
            input: BufReader::with_capacity(1 << 20, file),
            path: path.to_owned(),
            done: false,
        };
        let mut magic = [0u8; 5];
        r.input
            .read_exact(&mut magic)
            .map_err(|e| bad(path, format!("no header ({e})")))?;
        if &magic != MAGIC {
            return Err(bad(path, "not a Warren snapshot (or another version)"));
        }
        let meta = r.frame()?.ok_or_else(|| bad(path, "no meta frame"))?;
        let meta: SnapshotMeta =
            postcard::from_bytes(&meta).map_err(|e| bad(path, format!("meta: {e}")))?;
        Ok((meta, r))
    }

    /// The next frame's body; None at the end frame.
    fn frame(&mut self) -> io::Result<Option<Vec<u8>>> {
        if self.done {
            return Ok(None);
        }
        let mut head = [0u8; 8];
        self.input
            .read_exact(&mut head)
            .map_err(|e| bad(&self.path, format!("ends before its end frame ({e})")))?;
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if len == 0 && crc == 0 {
            self.done = true;
            return Ok(None);
        }
        if len > MAX_FRAME {
            return Err(bad(&self.path, format!("a frame of {len} bytes")));
        }
        // Read, not sized from the header: a damaged length on a short file would otherwise
        // allocate up to `MAX_FRAME` before the read found the file's end.
        let mut body = Vec::new();
        (&mut self.input)
            .take(u64::from(len))
            .read_to_end(&mut body)
            .map_err(|e| bad(&self.path, format!("a frame does not read ({e})")))?;
        if body.len() as u64 != u64::from(len) {
            return Err(bad(&self.path, "ends inside a frame"));
        }
        if crc32fast::hash(&body) != crc {
            return Err(bad(
                &self.path,
                "a frame's checksum does not match (damaged)",
            ));
        }
        Ok(Some(body))
    }

    /// The next group of ops; None once the end frame is read.
    pub fn group(&mut self) -> io::Result<Option<Vec<Op>>> {
        let Some(body) = self.frame()? else {
            return Ok(None);
        };
        warren_storage::op_codec::decode_ops(bytes::Bytes::from(body))
            .map(Some)
            .map_err(|e| bad(&self.path, format!("a group does not decode: {e}")))
    }
}

/// Just the meta of the snapshot file at `path` (None: no file).
pub fn read_meta(path: &Path) -> io::Result<Option<SnapshotMeta>> {
    match File::open(path) {
        Ok(f) => Reader::open(f, path).map(|(meta, _)| Some(meta)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Check the whole file at `path` (every frame's checksum and the end frame) without
/// decoding its groups; returns its meta.
pub fn verify(path: &Path) -> io::Result<SnapshotMeta> {
    let (meta, mut r) = Reader::open(File::open(path)?, path)?;
    while r.frame()?.is_some() {}
    Ok(meta)
}

/// fsync the folder `dir` (a rename or removal in it is then durable).
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::cluster::types::StoredMembership;

    fn meta() -> SnapshotMeta {
        SnapshotMeta {
            last_log_id: None,
            last_membership: StoredMembership::default(),
            snapshot_id: "1-2-3".into(),
        }
    }

    fn op(i: u64) -> Op {
        Op::DeleteQueue {
            vhost: "/".into(),
            name: format!("q{i}"),
        }
    }

    /// Groups come back as written; a cut file, a flipped byte and a file of something else
    /// are refused, never read as a shorter snapshot.
    #[test]
    fn groups_round_trip_and_damage_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let mut w = Writer::create(&path, &meta()).unwrap();
        w.group(&[op(1), op(2)]).unwrap();
        w.group(&[op(3)]).unwrap();
        w.finish().unwrap();
        let (m, mut r) = Reader::open(File::open(&path).unwrap(), &path).unwrap();
        assert_eq!(m.snapshot_id, "1-2-3");
        assert_eq!(r.group().unwrap().unwrap(), vec![op(1), op(2)]);
        assert_eq!(r.group().unwrap().unwrap(), vec![op(3)]);
        assert!(r.group().unwrap().is_none());
        verify(&path).unwrap();

        let whole = std::fs::read(&path).unwrap();
        let cut = dir.path().join("cut");
        std::fs::write(&cut, &whole[..whole.len() - 8]).unwrap();
        assert!(verify(&cut).is_err(), "a file without its end frame");

        let mut flipped = whole.clone();
        let at = whole.len() - 10;
        flipped[at] ^= 0x40;
        let f = dir.path().join("flipped");
        std::fs::write(&f, &flipped).unwrap();
        let e = verify(&f).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");

        let other = dir.path().join("other");
        std::fs::write(&other, b"not a snapshot at all").unwrap();
        assert!(read_meta(&other).is_err());
        assert!(read_meta(&dir.path().join("none")).unwrap().is_none());
    }

    /// A damaged frame length on a short file is found at the file's end, not allocated for:
    /// a header claiming the largest frame made a buffer of that size (1 GiB) first. Past the
    /// cap, the test binary aborts.
    #[test]
    fn a_frame_length_is_not_allocated_for_before_its_bytes_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let mut w = Writer::create(&path, &meta()).unwrap();
        w.group(&[op(1)]).unwrap();
        w.finish().unwrap();
        let mut damaged = std::fs::read(&path).unwrap();
        // The first group's frame: after the magic and the meta frame.
        let meta_len = u32::from_le_bytes(damaged[5..9].try_into().unwrap()) as usize;
        let at = 5 + 8 + meta_len;
        damaged[at..at + 4].copy_from_slice(&MAX_FRAME.to_le_bytes());
        std::fs::write(&path, &damaged).unwrap();
        let e = warren_storage::testing::allocating_at_most(&crate::ALLOC, 64 << 20, || {
            verify(&path).unwrap_err()
        });
        assert!(e.to_string().contains("ends inside a frame"), "{e}");
    }
}
