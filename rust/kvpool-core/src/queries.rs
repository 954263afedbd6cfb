//! Read-only queries. Each validates its handles (a stale handle is an error,
//! never someone else's data) and costs O(handles + pages returned).

use crate::allocator::{Request, SlotAllocator};
use crate::error::{PoolError, Result};
use crate::handle::handle_row;

/// FlashInfer's CSR page table of a batch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PageTable {
    /// `indptr[i]..indptr[i+1]` indexes request i's pages in `indices`.
    pub indptr: Vec<i32>,
    pub indices: Vec<i32>,
    /// Tokens in each request's last page, in [1, page_size]; 0 for an empty request.
    pub last_page_len: Vec<i32>,
}

impl SlotAllocator {
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }
    pub fn num_slots(&self) -> usize {
        self.num_pages * self.page_size
    }
    pub fn max_requests(&self) -> usize {
        self.max_requests
    }
    pub fn max_context_len(&self) -> usize {
        self.max_context_len
    }
    pub fn capacity_pages(&self) -> usize {
        self.num_pages - 1
    }
    pub fn capacity_slots(&self) -> usize {
        self.capacity_pages() * self.page_size
    }
    pub fn free_pages(&self) -> usize {
        self.free_pages.len()
    }
    pub fn used_pages(&self) -> usize {
        self.capacity_pages() - self.free_pages.len()
    }
    pub fn free_slots(&self) -> usize {
        self.free_pages.len() * self.page_size
    }
    /// Slots in held pages (including the unfilled tail of each last page).
    pub fn used_slots(&self) -> usize {
        self.used_pages() * self.page_size
    }
    pub fn open_requests(&self) -> usize {
        self.open_count
    }
    /// Tokens that could still be appended if every new token started a page
    /// (a lower bound: partly filled last pages take a few more).
    pub fn admissible_tokens(&self) -> usize {
        self.free_slots()
    }

    /// Heap bytes of all bookkeeping: 8 per page (owner + free stack entry),
    /// plus each row's page list (4 per held page, with Vec growth slack).
    pub fn metadata_bytes(&self) -> usize {
        let u32s = self.owner.capacity()
            + self.free_pages.capacity()
            + self.free_rows.capacity()
            + self.stamp.capacity()
            + self
                .requests
                .iter()
                .map(|r| r.pages.capacity())
                .sum::<usize>();
        u32s * 4 + self.requests.capacity() * std::mem::size_of::<Request>()
    }

    pub fn is_open(&self, handle: i64) -> bool {
        self.resolve(handle).is_ok()
    }

    pub fn length(&self, handle: i64) -> Result<usize> {
        Ok(self.requests[self.resolve(handle)?].len)
    }

    pub fn lengths(&self, handles: &[i64]) -> Result<Vec<i64>> {
        handles
            .iter()
            .map(|&h| Ok(self.requests[self.resolve(h)?].len as i64))
            .collect()
    }

    /// Rows (request-to-token table indices) of open handles.
    pub fn rows(&self, handles: &[i64]) -> Result<Vec<i64>> {
        handles
            .iter()
            .map(|&h| self.resolve(h).map(|r| r as i64))
            .collect()
    }

    /// Every slot of the request, in token order.
    pub fn slots(&self, handle: i64) -> Result<Vec<i64>> {
        let req = &self.requests[self.resolve(handle)?];
        let ps = self.page_size;
        let mut out = Vec::with_capacity(req.len);
        for (k, &p) in req.pages.iter().enumerate() {
            let n = ps.min(req.len - k * ps);
            let base = p as usize * ps;
            out.extend((base..base + n).map(|s| s as i64));
        }
        Ok(out)
    }

    pub fn pages(&self, handle: i64) -> Result<Vec<i32>> {
        let req = &self.requests[self.resolve(handle)?];
        Ok(req.pages.iter().map(|&p| p as i32).collect())
    }

    pub fn page_table(&self, handles: &[i64]) -> Result<PageTable> {
        let mut total = 0usize;
        for &h in handles {
            total += self.requests[self.resolve(h)?].pages.len();
        }
        if total > i32::MAX as usize {
            // Only reachable by naming the same requests over and over.
            return Err(PoolError::InvalidArgument(format!(
                "page table would hold {total} entries, past int32 indptr range"
            )));
        }
        let mut t = PageTable {
            indptr: Vec::with_capacity(handles.len() + 1),
            indices: Vec::with_capacity(total),
            last_page_len: Vec::with_capacity(handles.len()),
        };
        t.indptr.push(0);
        for &h in handles {
            let req = &self.requests[handle_row(h) as usize];
            t.indices.extend(req.pages.iter().map(|&p| p as i32));
            t.indptr.push(t.indices.len() as i32);
            let last = if req.len == 0 {
                0
            } else {
                (req.len - 1) % self.page_size + 1
            };
            t.last_page_len.push(last as i32);
        }
        Ok(t)
    }
}
