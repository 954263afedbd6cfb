//! Least recently used: the CACHED pages in one intrusive doubly linked
//! list, threaded through the pages' own records ([`Links`]), oldest first.
//! Record 0 (page 0, never handed out) is the sentinel: its `newer` link is
//! the oldest page, its `older` link the newest. Every operation is O(1)
//! per page, and a run of pages that are each other's neighbours leaves or
//! joins the list in one relink.

/// A record's place in an eviction list: its older and newer neighbours
/// (0 = the sentinel). Meaningful only while the record is listed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct Links {
    pub(super) older: u32,
    pub(super) newer: u32,
}

impl Links {
    /// On no list.
    pub(crate) const UNLINKED: Links = Links { older: 0, newer: 0 };

    /// The neighbour evicted just before this page.
    #[inline]
    pub(crate) fn older(&self) -> u32 {
        self.older
    }

    /// The neighbour evicted just after this page.
    #[inline]
    pub(crate) fn newer(&self) -> u32 {
        self.newer
    }
}

/// A record that carries [`Links`]: the page pool's records, and any later
/// tier's, share this list code.
pub(crate) trait Linked {
    fn links(&self) -> &Links;
    fn links_mut(&mut self) -> &mut Links;
}

/// The list's bookkeeping beside the links: how many pages are on it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Lru {
    len: usize,
}

/// A bulk append in progress (`Lru::begin_append`): the newest page stays
/// in a register instead of being re-read from the sentinel per page.
pub(crate) struct Append {
    newest: u32,
    pub(super) added: usize,
}

impl Lru {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The oldest page (0: the list is empty).
    #[inline]
    pub(crate) fn oldest<R: Linked>(&self, recs: &[R]) -> u32 {
        recs[0].links().newer
    }

    /// Appends `p` as the newest page.
    pub(crate) fn push<R: Linked>(&mut self, recs: &mut [R], p: u32) {
        let newest = recs[0].links().older;
        recs[newest as usize].links_mut().newer = p;
        *recs[p as usize].links_mut() = Links {
            older: newest,
            newer: 0,
        };
        recs[0].links_mut().older = p;
        self.len += 1;
    }

    #[inline]
    pub(crate) fn remove<R: Linked>(&mut self, recs: &mut [R], p: u32) {
        let Links { older, newer } =
            std::mem::replace(recs[p as usize].links_mut(), Links::UNLINKED);
        recs[older as usize].links_mut().newer = newer;
        recs[newer as usize].links_mut().older = older;
        self.len -= 1;
    }

    /// Removes and returns the oldest page.
    #[inline]
    pub(crate) fn pop_oldest<R: Linked>(&mut self, recs: &mut [R]) -> Option<u32> {
        let p = self.oldest(recs);
        if p == 0 {
            return None;
        }
        self.remove(recs, p);
        Some(p)
    }

    #[inline]
    pub(crate) fn begin_append<R: Linked>(recs: &[R]) -> Append {
        Append {
            newest: recs[0].links().older,
            added: 0,
        }
    }

    /// Appends `p` as the newest page of the append `a`; its own `newer`
    /// link is written by the next append or by `end_append`.
    #[inline]
    pub(crate) fn append<R: Linked>(recs: &mut [R], a: &mut Append, p: u32) {
        recs[p as usize].links_mut().older = a.newest;
        recs[a.newest as usize].links_mut().newer = p;
        a.newest = p;
        a.added += 1;
    }

    /// Appends four pages, oldest first, as `append` would one by one: each
    /// record's two links in one store, none read back.
    #[inline]
    pub(crate) fn append4<R: Linked>(recs: &mut [R], a: &mut Append, [p0, p1, p2, p3]: [u32; 4]) {
        recs[a.newest as usize].links_mut().newer = p0;
        *recs[p0 as usize].links_mut() = Links {
            older: a.newest,
            newer: p1,
        };
        *recs[p1 as usize].links_mut() = Links {
            older: p0,
            newer: p2,
        };
        *recs[p2 as usize].links_mut() = Links {
            older: p1,
            newer: p3,
        };
        recs[p3 as usize].links_mut().older = p2;
        a.newest = p3;
        a.added += 4;
    }

    #[inline]
    pub(crate) fn end_append<R: Linked>(&mut self, recs: &mut [R], a: Append) {
        recs[a.newest as usize].links_mut().newer = 0;
        recs[0].links_mut().older = a.newest;
        self.len += a.added;
    }

    /// Unlinks the `n` pages from `newest` back to `oldest`, which are each
    /// other's neighbours, in one relink; their own links are the caller's
    /// to clear.
    #[inline]
    pub(crate) fn remove_run<R: Linked>(
        &mut self,
        recs: &mut [R],
        newest: u32,
        oldest: u32,
        n: usize,
    ) {
        let newer = recs[newest as usize].links().newer;
        let older = recs[oldest as usize].links().older;
        recs[older as usize].links_mut().newer = newer;
        recs[newer as usize].links_mut().older = older;
        self.len -= n;
    }

    /// Cuts the `n` oldest pages off the list, `rest` being the page after
    /// them (0: none); their own links are the caller's to clear.
    #[inline]
    pub(crate) fn cut_oldest<R: Linked>(&mut self, recs: &mut [R], n: usize, rest: u32) {
        recs[0].links_mut().newer = rest;
        recs[rest as usize].links_mut().older = 0;
        self.len -= n;
    }

    /// Walks the list from the oldest page; `visit(p)` sees each page and
    /// returns false to stop. Err(page) names a link that is broken (out
    /// of range, or its back link disagrees); the walk never loops.
    pub(crate) fn check<R: Linked>(
        &self,
        recs: &[R],
        mut visit: impl FnMut(u32) -> bool,
    ) -> std::result::Result<usize, String> {
        let mut walked = 0usize;
        let mut p = recs[0].links().newer as usize;
        let mut prev = 0usize;
        while p != 0 {
            if p >= recs.len() || walked >= recs.len() || !visit(p as u32) {
                return Err(format!(
                    "LRU list entry {p} is out of range, repeated or on the free stack"
                ));
            }
            if recs[p].links().older as usize != prev {
                return Err(format!("LRU list back link of page {p} is broken"));
            }
            walked += 1;
            prev = p;
            p = recs[p].links().newer as usize;
        }
        if recs[0].links().older as usize != prev || walked != self.len {
            return Err(format!(
                "LRU list walks {walked} pages but counts {}",
                self.len
            ));
        }
        Ok(walked)
    }
}
