//! The pool's fixed shape, set at construction and never changed. The
//! allocator and the owners that compute with it keep a copy.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub(crate) page_size: usize,
    /// log2(page_size) when it is a power of two: a shift instead of an
    /// integer division (tens of cycles) on the per-token path.
    pub(crate) page_shift: Option<u32>,
    /// Pages, the reserved page 0 included.
    pub(crate) num_pages: usize,
    pub(crate) max_context_len: usize,
}

impl Geometry {
    pub(crate) fn new(num_pages: usize, page_size: usize, max_context_len: usize) -> Self {
        Geometry {
            page_size,
            page_shift: page_size
                .is_power_of_two()
                .then(|| page_size.trailing_zeros()),
            num_pages,
            max_context_len,
        }
    }

    /// Pages needed to hold `len` tokens.
    #[inline]
    pub(crate) fn pages_for(&self, len: usize) -> usize {
        match self.page_shift {
            Some(s) => (len + self.page_size - 1) >> s,
            None => len.div_ceil(self.page_size),
        }
    }

    /// Position of token `len` inside its page (0 when it starts a page).
    #[inline]
    pub(crate) fn offset_in_page(&self, len: usize) -> usize {
        match self.page_shift {
            Some(_) => len & (self.page_size - 1),
            None => len % self.page_size,
        }
    }

    pub(crate) fn num_slots(&self) -> usize {
        self.num_pages * self.page_size
    }
}

/// Writes `first, first + 1, ...` into `dst` (the slots of one page run).
#[inline]
pub(crate) fn fill_run(dst: &mut [i64], first: usize) {
    if let [d] = dst {
        // The decode step's single slot: skip the vector loop's set-up.
        *d = first as i64;
        return;
    }
    for (j, d) in dst.iter_mut().enumerate() {
        *d = (first + j) as i64;
    }
}
