//! A message body as it came off the wire: the payloads of its body frames, shared with the read
//! buffer, never concatenated.
//!
//! Why: a 1 MiB message arrives as eight 128 KiB body frames. Gluing them into one buffer was a
//! full copy of every large body (a quarter of the broker's CPU on 1 MiB messages); keeping the
//! frame slices lets the outbox hand the same memory to a vectored write and the store copy it
//! once into its record.

use bytes::{Buf, Bytes, BytesMut};
use std::sync::Arc;

/// An immutable message body, cheap to clone (reference counted, like [`Bytes`]).
#[derive(Clone, Default)]
pub struct Body(Repr);

#[derive(Clone)]
enum Repr {
    One(Bytes),
    /// Two or more non-empty parts; `usize` is their total length.
    Many(Arc<[Bytes]>, usize),
}

impl Default for Repr {
    fn default() -> Self {
        Repr::One(Bytes::new())
    }
}

impl Body {
    pub const fn new() -> Self {
        Body(Repr::One(Bytes::new()))
    }

    /// A body from consecutive parts (empty parts are dropped).
    pub fn from_parts(mut parts: Vec<Bytes>) -> Self {
        parts.retain(|p| !p.is_empty());
        match parts.len() {
            0 => Body::new(),
            1 => Body(Repr::One(parts.pop().unwrap_or_default())),
            _ => {
                let len = parts.iter().map(Bytes::len).sum();
                Body(Repr::Many(parts.into(), len))
            }
        }
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::One(b) => b.len(),
            Repr::Many(_, len) => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The parts in order (one for a body that came in a single frame).
    pub fn parts(&self) -> &[Bytes] {
        match &self.0 {
            Repr::One(b) => std::slice::from_ref(b),
            Repr::Many(parts, _) => parts,
        }
    }

    /// The body as one contiguous buffer: free for a single part, a copy otherwise.
    pub fn to_bytes(&self) -> Bytes {
        match &self.0 {
            Repr::One(b) => b.clone(),
            Repr::Many(parts, len) => {
                let mut out = BytesMut::with_capacity(*len);
                for p in parts.iter() {
                    out.extend_from_slice(p);
                }
                out.freeze()
            }
        }
    }

    /// A reader over the body's bytes, part after part (no copy).
    pub fn reader(&self) -> BodyReader<'_> {
        BodyReader {
            parts: self.parts(),
            offset: 0,
            remaining: self.len(),
        }
    }
}

/// [`Buf`] over a [`Body`]; also hands out the next `n` bytes as shared slices.
#[derive(Debug)]
pub struct BodyReader<'a> {
    parts: &'a [Bytes],
    /// Bytes of `parts[0]` already read.
    offset: usize,
    remaining: usize,
}

impl BodyReader<'_> {
    /// The next piece of at most `max` bytes, as a slice sharing the body's memory.
    pub fn next_slice(&mut self, max: usize) -> Option<Bytes> {
        if max == 0 || self.remaining == 0 {
            return None;
        }
        let part = &self.parts[0];
        let n = (part.len() - self.offset).min(max);
        let piece = part.slice(self.offset..self.offset + n);
        self.advance(n);
        Some(piece)
    }
}

impl Buf for BodyReader<'_> {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        match self.parts.first() {
            Some(p) => &p[self.offset..],
            None => &[],
        }
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.remaining, "advance past the end of a body");
        self.remaining -= cnt;
        while cnt > 0 {
            let left = self.parts[0].len() - self.offset;
            if cnt < left {
                self.offset += cnt;
                return;
            }
            cnt -= left;
            self.parts = &self.parts[1..];
            self.offset = 0;
        }
        // Skip parts that are now fully read so `chunk` is never empty while bytes remain.
        while self.remaining > 0 && self.offset == self.parts[0].len() {
            self.parts = &self.parts[1..];
            self.offset = 0;
        }
    }
}

impl From<Bytes> for Body {
    fn from(b: Bytes) -> Self {
        Body(Repr::One(b))
    }
}

impl From<Vec<u8>> for Body {
    fn from(v: Vec<u8>) -> Self {
        Body(Repr::One(Bytes::from(v)))
    }
}

impl From<&'static [u8]> for Body {
    fn from(s: &'static [u8]) -> Self {
        Body(Repr::One(Bytes::from_static(s)))
    }
}

impl From<&'static str> for Body {
    fn from(s: &'static str) -> Self {
        Body(Repr::One(Bytes::from_static(s.as_bytes())))
    }
}

impl PartialEq for Body {
    fn eq(&self, other: &Body) -> bool {
        self.len() == other.len() && {
            let (mut a, mut b) = (self.reader(), other.reader());
            while a.has_remaining() {
                let n = a.chunk().len().min(b.chunk().len());
                if a.chunk()[..n] != b.chunk()[..n] {
                    return false;
                }
                a.advance(n);
                b.advance(n);
            }
            true
        }
    }
}

impl Eq for Body {}

impl PartialEq<[u8]> for Body {
    fn eq(&self, other: &[u8]) -> bool {
        self.len() == other.len() && {
            let mut at = 0;
            self.parts().iter().all(|p| {
                let same = other[at..at + p.len()] == p[..];
                at += p.len();
                same
            })
        }
    }
}

impl PartialEq<&[u8]> for Body {
    fn eq(&self, other: &&[u8]) -> bool {
        self == *other
    }
}

impl<const N: usize> PartialEq<&[u8; N]> for Body {
    fn eq(&self, other: &&[u8; N]) -> bool {
        self == &other[..]
    }
}

impl PartialEq<Bytes> for Body {
    fn eq(&self, other: &Bytes) -> bool {
        self == &other[..]
    }
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Repr::One(b) => b.fmt(f),
            Repr::Many(parts, len) => write!(f, "Body({len} bytes in {} parts)", parts.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts() -> Body {
        Body::from_parts(vec![
            Bytes::from_static(b"abc"),
            Bytes::new(),
            Bytes::from_static(b"d"),
            Bytes::from_static(b"efgh"),
        ])
    }

    #[test]
    fn parts_read_as_one_body() {
        let b = parts();
        assert_eq!(b.len(), 8);
        assert_eq!(b.parts().len(), 3);
        assert_eq!(&b.to_bytes()[..], b"abcdefgh");
        assert_eq!(b, Body::from(&b"abcdefgh"[..]));
        assert_ne!(b, Body::from(&b"abcdefgx"[..]));
        let mut r = b.reader();
        let mut got = Vec::new();
        while let Some(s) = r.next_slice(3) {
            assert!(s.len() <= 3);
            got.push(s);
        }
        let lens: Vec<usize> = got.iter().map(Bytes::len).collect();
        assert_eq!(lens, [3, 1, 3, 1]);
        let mut r = b.reader();
        r.advance(3);
        assert_eq!(r.chunk(), b"d");
        r.advance(2);
        assert_eq!(r.chunk(), b"fgh");
        assert_eq!(r.copy_to_bytes(3), Bytes::from_static(b"fgh"));
        assert!(!r.has_remaining());
    }

    #[test]
    fn single_and_empty_bodies() {
        assert!(Body::from_parts(vec![Bytes::new()]).is_empty());
        let one = Body::from_parts(vec![Bytes::from_static(b"x")]);
        assert_eq!(one.parts().len(), 1);
        assert_eq!(one, Bytes::from_static(b"x"));
        assert!(Body::new().reader().next_slice(10).is_none());
    }
}
