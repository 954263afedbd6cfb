//! Where a page's bytes are: a device page id, or a host page id marked with
//! the [`HOST`] bit. One u32 names either, so a prefix-index entry and a
//! swapped-out request's page list say where each page lives without a
//! second field to read.
//!
//! Device pages are below 2^31 (`num_pages <= 2^31 - 1`) and so are host
//! pages, so the bit never clashes with an id. Host page 0 is reserved, as
//! device page 0 is, so `HOST | 0` is never a real location.

/// The bit that marks a host page id.
pub(crate) const HOST: u32 = 1 << 31;

/// Whether `loc` names a host page.
#[inline]
pub(crate) fn is_host(loc: u32) -> bool {
    loc & HOST != 0
}

/// The host page a host location names.
#[inline]
pub(crate) fn host_page(loc: u32) -> u32 {
    loc & !HOST
}

/// The location of host page `h`.
#[inline]
pub(crate) fn on_host(h: u32) -> u32 {
    h | HOST
}
