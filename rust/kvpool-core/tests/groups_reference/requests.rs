//! The grouped model's requests: opening, closing, resetting and forking,
//! each group following the anchor's rows.

use super::{GGroup, GModel};
use crate::reference::Kind;

impl GModel {
    pub fn open(&mut self, n: usize) -> Result<Vec<i64>, Kind> {
        if n > self.anchor.free_rows.len() {
            return Err(Kind::TooMany);
        }
        self.state_room(n)?;
        let hs = self.anchor.open(n)?;
        for &h in &hs {
            self.open_row((h & 0xFFFF_FFFF) as usize);
        }
        Ok(hs)
    }

    pub fn close(&mut self, hs: &[i64], cache: bool) -> Result<(), Kind> {
        let rows = self.anchor.rows(hs)?;
        if cache {
            self.register(&rows);
        }
        let lens: Vec<usize> = rows.iter().map(|&r| self.len(r)).collect();
        self.anchor.close(hs, false).expect("checked");
        self.close_rows(&rows, &lens);
        Ok(())
    }

    fn close_rows(&mut self, rows: &[usize], lens: &[usize]) {
        for g in self.groups.iter_mut() {
            match g {
                GGroup::Anchor => {}
                GGroup::Pages(e) => {
                    for (&r, &len) in rows.iter().zip(lens) {
                        e.shrink(r, len, 0);
                    }
                }
                GGroup::State(e) => {
                    for &r in rows {
                        e.close_row(r);
                    }
                }
            }
        }
    }

    pub fn reset(&mut self) {
        let rows: Vec<usize> = self.anchor.reqs.keys().copied().collect();
        let lens: Vec<usize> = rows.iter().map(|&r| self.len(r)).collect();
        self.anchor.reset();
        self.close_rows(&rows, &lens);
    }

    pub fn fork(&mut self, h: i64, n: usize) -> Result<Vec<i64>, Kind> {
        let parent = self.anchor.row(h).ok_or(Kind::Handle)?;
        if n > self.anchor.free_rows.len() {
            return Err(Kind::TooMany);
        }
        self.state_room(n)?;
        let kids = self.anchor.fork(h, n).expect("checked");
        let len = self.len(parent);
        for &k in &kids {
            let row = (k & 0xFFFF_FFFF) as usize;
            for g in self.groups.iter_mut() {
                match g {
                    GGroup::Anchor => {}
                    GGroup::Pages(e) => e.fork_row(parent, row, len),
                    GGroup::State(e) => e.fork_row(parent, row),
                }
            }
        }
        Ok(kids)
    }
}
