//! Property test: random operation sequences run against the allocator and
//! against a deliberately naive reference model (one slot list per request,
//! everything recomputed from scratch); results, errors and observable state
//! must agree, and check() must pass after every operation.

use std::collections::BTreeMap;

use kvpool_core::{make_handle, Counts, PoolError, SlotAllocator};
use proptest::prelude::*;

const MAX_REQ: usize = 4;
const MAX_CTX: usize = 12;

/// Naive model: same policies (LIFO pages and rows), written the obvious way.
struct Model {
    ps: usize,
    free: Vec<usize>,                // free pages, top = end
    free_rows: Vec<usize>,           // top = end
    generation: Vec<u32>,            // per row
    reqs: BTreeMap<usize, Vec<i64>>, // open row -> slot of every token
}

#[derive(Debug, PartialEq)]
enum Kind {
    Exhausted,
    Handle,
    TooMany,
    TooLong,
    Arg,
}

fn kind(e: &PoolError) -> Kind {
    match e {
        PoolError::Exhausted { .. } => Kind::Exhausted,
        PoolError::InvalidHandle { .. } => Kind::Handle,
        PoolError::TooManyRequests { .. } => Kind::TooMany,
        PoolError::ContextTooLong { .. } => Kind::TooLong,
        PoolError::InvalidArgument(_) => Kind::Arg,
        PoolError::Invariant(m) => panic!("invariant error from a valid op: {m}"),
    }
}

impl Model {
    fn new(pages: usize, ps: usize) -> Self {
        Model {
            ps,
            free: (1..pages).rev().collect(),
            free_rows: (0..MAX_REQ).rev().collect(),
            generation: vec![0; MAX_REQ],
            reqs: BTreeMap::new(),
        }
    }

    fn row(&self, h: i64) -> Option<usize> {
        let row = (h & 0xFFFF_FFFF) as usize;
        let open = h >= 0 && row < MAX_REQ && self.reqs.contains_key(&row);
        (open && (h >> 32) as u32 == self.generation[row]).then_some(row)
    }

    fn pages_of(&self, row: usize) -> Vec<usize> {
        let mut pages: Vec<usize> = Vec::new();
        for (t, &s) in self.reqs[&row].iter().enumerate() {
            if t % self.ps == 0 {
                pages.push(s as usize / self.ps);
            }
        }
        pages
    }

    /// Rows of a batch, or the error kind of its first bad handle/duplicate.
    fn rows(&self, hs: &[i64]) -> Result<Vec<usize>, Kind> {
        let mut rows: Vec<usize> = Vec::new();
        for &h in hs {
            let r = self.row(h).ok_or(Kind::Handle)?;
            if rows.contains(&r) {
                return Err(Kind::Arg);
            }
            rows.push(r);
        }
        Ok(rows)
    }

    fn open(&mut self, n: usize) -> Result<Vec<i64>, Kind> {
        if n > self.free_rows.len() {
            return Err(Kind::TooMany);
        }
        let mut out = Vec::new();
        for _ in 0..n {
            let row = self.free_rows.pop().unwrap();
            self.generation[row] += 1;
            self.reqs.insert(row, Vec::new());
            out.push(make_handle(self.generation[row], row as u32));
        }
        Ok(out)
    }

    fn extend(&mut self, hs: &[i64], cs: &[i64]) -> Result<Vec<i64>, Kind> {
        let mut rows = Vec::new();
        let mut need = 0;
        for (i, &h) in hs.iter().enumerate() {
            let r = self.row(h).ok_or(Kind::Handle)?;
            if rows.contains(&r) {
                return Err(Kind::Arg);
            }
            rows.push(r);
            if cs[i] < 0 {
                return Err(Kind::Arg);
            }
            let (len, c) = (self.reqs[&r].len(), cs[i] as usize);
            if len + c > MAX_CTX {
                return Err(Kind::TooLong);
            }
            need += (len + c).div_ceil(self.ps) - len.div_ceil(self.ps);
        }
        if need > self.free.len() {
            return Err(Kind::Exhausted);
        }
        let mut out = Vec::new();
        for (i, &r) in rows.iter().enumerate() {
            for _ in 0..cs[i] {
                let t = self.reqs[&r].len();
                let page = if t % self.ps == 0 {
                    self.free.pop().unwrap()
                } else {
                    *self.pages_of(r).last().unwrap()
                };
                let slot = (page * self.ps + t % self.ps) as i64;
                self.reqs.get_mut(&r).unwrap().push(slot);
                out.push(slot);
            }
        }
        Ok(out)
    }

    fn truncate(&mut self, hs: &[i64], ls: &[i64]) -> Result<(), Kind> {
        // Entries are validated in order, each completely (handle, then value).
        for i in 0..hs.len() {
            let r = self.rows(&hs[..=i])?[i];
            if ls[i] < 0 || ls[i] as usize > self.reqs[&r].len() {
                return Err(Kind::Arg);
            }
        }
        let rows = self.rows(hs)?;
        for (&r, &l) in rows.iter().zip(ls) {
            let pages = self.pages_of(r);
            let keep = (l as usize).div_ceil(self.ps);
            self.free.extend(pages[keep..].iter().rev());
            self.reqs.get_mut(&r).unwrap().truncate(l as usize);
        }
        Ok(())
    }

    fn close(&mut self, hs: &[i64]) -> Result<(), Kind> {
        let rows = self.rows(hs)?;
        for r in rows {
            let pages = self.pages_of(r);
            self.free.extend(pages.iter().rev());
            self.reqs.remove(&r);
            self.free_rows.push(r);
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum Op {
    Open(usize),
    /// (index into issued handles, count)
    Extend(Vec<(usize, i64)>),
    Truncate(Vec<(usize, i64)>),
    Close(Vec<usize>),
}

/// Handle picks below OPEN_PICKS name an open request (if any); the rest name
/// any handle ever issued, so stale, closed and bogus handles show up too.
const OPEN_PICKS: usize = 14;

fn op() -> impl Strategy<Value = Op> {
    let pick = 0usize..16;
    let value = prop_oneof![1 => Just(-1i64), 12 => 0i64..7];
    prop_oneof![
        2 => (0usize..4).prop_map(Op::Open),
        4 => prop::collection::vec((pick.clone(), value.clone()), 0..4).prop_map(Op::Extend),
        2 => prop::collection::vec((pick.clone(), value), 0..3).prop_map(Op::Truncate),
        1 => prop::collection::vec(pick, 0..3).prop_map(Op::Close),
    ]
}

/// Asserts agreement; returns whether the call succeeded.
fn same<T: PartialEq + std::fmt::Debug>(
    real: Result<T, PoolError>,
    model: Result<T, Kind>,
) -> bool {
    match (real, model) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a, b);
            return true;
        }
        (Err(e), Err(k)) => assert_eq!(kind(&e), k, "{e}"),
        (a, b) => panic!("allocator {a:?} but model {b:?}"),
    }
    false
}

// Miri interprets every step (~1000x slower): a handful of cases there.
const CASES: u32 = if cfg!(miri) { 6 } else { 3000 };

static OK_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]
    #[test]
    fn allocator_matches_model(ps in 1usize..4, pages in 1usize..14, ops in prop::collection::vec(op(), 1..60)) {
        let mut a = SlotAllocator::new(pages, ps, MAX_REQ, MAX_CTX).unwrap();
        let mut m = Model::new(pages, ps);
        // Every handle ever issued, plus two that never were: stale and
        // closed handles get picked as often as live ones.
        let mut issued: Vec<i64> = vec![-5, make_handle(3, 1)];
        let mut oks = 0usize;
        for op in ops {
            let open: Vec<i64> = issued.iter().copied().filter(|&x| m.row(x).is_some()).collect();
            let h = |i: usize| {
                if i < OPEN_PICKS && !open.is_empty() { open[i % open.len()] } else { issued[i % issued.len()] }
            };
            match op {
                Op::Open(n) => {
                    let (r, mr) = (a.open(n), m.open(n));
                    if let Ok(hs) = &mr { issued.extend(hs); }
                    oks += same(r, mr) as usize;
                }
                Op::Extend(v) => {
                    let (hs, cs): (Vec<i64>, Vec<i64>) = v.iter().map(|&(i, c)| (h(i), c)).unzip();
                    let before: Vec<usize> = hs.iter().map(|&x| m.row(x).map_or(0, |r| m.reqs[&r].len())).collect();
                    let mr = m.extend(&hs, &cs);
                    let r = if hs.len() % 2 == 0 {
                        a.extend(&hs, Counts::PerRequest(&cs))
                    } else {
                        // extend_into must agree, and report each request's row,
                        // old length and new slots in batch order.
                        let mut out = vec![-1; cs.iter().filter(|&&c| c > 0).sum::<i64>() as usize];
                        let mut seen = Vec::new();
                        let r = a.extend_into(&hs, Counts::PerRequest(&cs), &mut out, |i, row, start, s| {
                            seen.push((i, row as i64, start, s.to_vec()))
                        });
                        r.map(|()| {
                            let mut k = 0;
                            let want: Vec<_> = (0..hs.len()).map(|i| {
                                let n = cs[i] as usize;
                                k += n;
                                (i, hs[i] & 0xFFFF_FFFF, before[i], out[k - n..k].to_vec())
                            }).collect();
                            assert_eq!(seen, want);
                            out
                        })
                    };
                    oks += same(r, mr) as usize;
                }
                Op::Truncate(v) => {
                    let (hs, ls): (Vec<i64>, Vec<i64>) = v.iter().map(|&(i, l)| (h(i), l)).unzip();
                    oks += same(a.truncate(&hs, Counts::PerRequest(&ls)), m.truncate(&hs, &ls)) as usize;
                }
                Op::Close(v) => {
                    let hs: Vec<i64> = v.iter().map(|&i| h(i)).collect();
                    oks += same(a.close(&hs), m.close(&hs)) as usize;
                }
            }
            a.check().unwrap();
            prop_assert_eq!(a.free_pages(), m.free.len());
            prop_assert_eq!(a.open_requests(), m.reqs.len());
            for &hh in &issued {
                match m.row(hh) {
                    Some(r) => {
                        prop_assert_eq!(a.slots(hh).unwrap(), m.reqs[&r].clone());
                        prop_assert_eq!(a.length(hh).unwrap(), m.reqs[&r].len());
                    }
                    None => prop_assert!(!a.is_open(hh)),
                }
            }
        }
        OK_CALLS.fetch_add(oks, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Guards the generator itself: most calls must succeed, or the model
/// comparison only ever exercises error paths.
#[test]
fn generated_sequences_mostly_succeed() {
    allocator_matches_model();
    let oks = OK_CALLS.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        oks > CASES as usize * 10,
        "only {oks} successful calls in {CASES} sequences"
    );
}
