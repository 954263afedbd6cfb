//! `check()` of a grouped pool: the anchor's own invariants, each group's
//! (`paged.rs`, `state.rs`), and what ties them to the request table:
//!
//! - every open row has a live slot in every state group, a closed row none;
//! - a row's registration ids follow its anchor chain (one per chain page),
//!   and no group's cache progress runs past them;
//! - a token-only anchor keeps no queued copies (it has nothing to copy).

use super::{Group, GroupedAllocator};
use crate::error::{PoolError, Result};

impl GroupedAllocator {
    pub fn check(&self) -> Result<()> {
        self.anchor.check()?;
        self.check_groups().map_err(PoolError::Invariant)
    }

    fn check_groups(&self) -> std::result::Result<(), String> {
        let mut rows = Vec::new();
        let mut open = vec![false; self.anchor.max_requests()];
        for (row, o) in open.iter_mut().enumerate() {
            match self.anchor.group_row_len(row) {
                Some(len) => {
                    rows.push((row, len));
                    *o = true;
                    let chain = self.anchor.group_chain_pages(row);
                    if self.regs[row].len() != chain {
                        return Err(format!(
                            "row {row} keeps {} anchor registration ids for a chain of {chain} pages",
                            self.regs[row].len()
                        ));
                    }
                }
                None if !self.regs[row].is_empty() => {
                    return Err(format!("closed row {row} keeps anchor registration ids"));
                }
                None => {}
            }
        }
        for (g, e) in self.groups.iter().enumerate() {
            let r = match e {
                Group::Anchor => Ok(()),
                Group::Pages(e) => e.check(&rows).and_then(|()| {
                    for &(row, _) in &rows {
                        if e.progress(row) * e.page_size() > self.regs[row].len() * self.a {
                            return Err(format!(
                                "row {row}'s cache progress is past its anchor chain"
                            ));
                        }
                    }
                    Ok(())
                }),
                Group::State(e) => e.check(&open),
            };
            r.map_err(|m| format!("group {g} ({}): {m}", self.specs[g].kind.name()))?;
        }
        if self.anchor_group.is_none() && self.anchor.pending_copies() > 0 {
            return Err("the token-only anchor keeps queued copies".into());
        }
        Ok(())
    }
}
