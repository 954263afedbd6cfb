//! The serving trace of `hit_oracle.rs`: one pool driven by an engine's
//! calls, each `open_with_prefix` checked against the oracle (`oracle/`),
//! and a twin without KV events given the same calls (`twin.rs`).

mod twin;

use std::collections::{HashMap, HashSet};

use kvpool_core::{Counts, HostPolicy, Options, PoolError};
use proptest::prelude::*;

use crate::oracle::{page_hashes, prompt_hashes, Ideal, Registry};
use crate::router::Router;
use twin::Twin;

const MAX_REQ: usize = 8;

/// One open request as the engine knows it: its salt, every token id it
/// has (its prompt, then outputs; past its length, what it will compute
/// next), and how many leading pages `cache()` published.
#[derive(Clone)]
struct Req {
    salt: i64,
    script: Vec<i32>,
    published: usize,
}

#[derive(Debug, Clone)]
pub enum Op {
    /// Prompts: (kind, pick, cut, new message, seed, salt). Kind 0: a
    /// system prompt (`pick`) and a message, under a salt; 1: a cached
    /// transcript (`pick`) and a message, a chat's next turn; 2: a cached
    /// transcript cut at `cut`, and a message.
    Open(Vec<(u8, u8, u8, u8, u8, u8)>),
    /// (request, tokens) per request, and the outputs' seed.
    Extend(Vec<(u8, u8)>, u8),
    /// A request's prefill of what is left of its prompt, plus outputs.
    Prefill(u8, u8),
    /// Request, priority (None: plain `cache`).
    Cache(u8, Option<u8>),
    /// Request, cache, priority.
    Close(u8, bool, Option<u8>),
    /// Request, children (parallel sampling).
    Fork(u8, u8),
    /// Request, new length as a fraction of 256, new tokens after it.
    Truncate(u8, u8, bool),
    Evict(u8),
    Tick(u8),
    Unpin(u8),
}

/// Priorities a trace gives: low, the default, high, a pin.
const PRIOS: [u8; 4] = [0, 35, 90, 100];

pub struct World {
    a: Twin,
    router: Router,
    registry: Registry,
    seed: u64,
    ps: usize,
    host: usize,
    reqs: HashMap<i64, Req>,
    /// Order of opening, for picks.
    order: Vec<i64>,
    /// Transcripts of cached requests (token ids, salt): later turns.
    history: Vec<(Vec<i32>, i64)>,
    now: f64,
    rng: u64,
}

impl World {
    pub fn new(pages: usize, ps: usize, host: usize, policy: HostPolicy, pins: usize) -> Self {
        let opts = Options {
            hash_seed: Some(11),
            host_pages: host,
            host_policy: policy,
            manual_clock: true,
            max_pinned_pages: Some(pins.min(pages - 1)),
            ..Options::new()
        };
        let a = Twin::new(pages, ps, MAX_REQ, max_ctx(ps), opts);
        let seed = a.hash_seed();
        World {
            a,
            router: Router::new(seed, ps),
            registry: Registry::default(),
            seed,
            ps,
            host,
            reqs: HashMap::new(),
            order: Vec::new(),
            history: Vec::new(),
            now: 0.0,
            rng: 1,
        }
    }

    fn pick(&self, i: u8) -> Option<i64> {
        let open: Vec<i64> = self
            .order
            .iter()
            .copied()
            .filter(|h| self.reqs.contains_key(h))
            .collect();
        (!open.is_empty()).then(|| open[i as usize % open.len()])
    }

    /// An output token: a small alphabet, so that different requests
    /// often compute the same pages.
    fn token(&mut self) -> i32 {
        self.rng = self
            .rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.rng >> 33) % 3) as i32 + 1
    }

    /// The engine's step after every call: the queued transfers run, and
    /// the router takes the events.
    fn settle(&mut self) -> Result<(), TestCaseError> {
        self.a.take_offloads();
        self.a.take_loads();
        self.a.take_copies();
        let e = self.a.take_events();
        self.router.apply(&e).map_err(TestCaseError::fail)?;
        self.registry.apply(&e);
        self.a
            .check()
            .map_err(|e| TestCaseError::fail(format!("check: {e}")))?;
        Ok(())
    }

    fn prompt(
        &mut self,
        (kind, pick, cut, more, seed, salt): (u8, u8, u8, u8, u8, u8),
    ) -> (Vec<i32>, i64) {
        let ps = self.ps;
        let (mut p, salt) = match kind % 3 {
            k if k > 0 && !self.history.is_empty() => {
                let (t, s) = &self.history[pick as usize % self.history.len()];
                let mut t = t.clone();
                if k == 2 {
                    t.truncate(cut as usize % (t.len() + 1));
                }
                (t, *s)
            }
            _ => {
                // A system prompt: the same ids for a pick, whatever salt.
                let k = pick as usize % 3;
                let len = ps * (1 + k) + seed as usize % ps;
                let p = (0..len).map(|i| (100 * k + i) as i32).collect();
                (p, [0, 0, 3][salt as usize % 3])
            }
        };
        let n = (more as usize % 3) * ps / 2 + (seed as usize % 3);
        for _ in 0..n {
            let t = self.token();
            p.push(t);
        }
        p.truncate(max_ctx(ps) - 2 * ps);
        (p, salt)
    }

    fn open(&mut self, spec: &[(u8, u8, u8, u8, u8, u8)]) -> Result<(), TestCaseError> {
        let (ps, seed) = (self.ps, self.seed);
        let prompts: Vec<(Vec<i32>, i64)> = spec.iter().map(|&s| self.prompt(s)).collect();
        let hashes: Vec<Vec<u128>> = prompts
            .iter()
            .map(|(p, s)| prompt_hashes(seed, ps, *s, p))
            .collect();
        let mut held_pages = HashSet::new();
        for &h in self.reqs.keys() {
            held_pages.extend(self.a.pages(h).unwrap());
        }
        let ideal = Ideal::new(&self.router);
        let reachable: Vec<usize> = hashes.iter().map(|h| self.registry.reachable(h)).collect();
        let room = ideal.pages_needed(&hashes, &held_pages) <= self.a.free_pages();
        let flat: Vec<i64> = prompts
            .iter()
            .flat_map(|(p, _)| p.iter().map(|&t| t as i64))
            .collect();
        let lens: Vec<i64> = prompts.iter().map(|(p, _)| p.len() as i64).collect();
        let salts: Vec<i64> = prompts.iter().map(|(_, s)| *s).collect();
        let (hs, cached) = match self
            .a
            .open_with_prefix(&flat, &lens, Counts::PerRequest(&salts))
        {
            Ok(x) => x,
            Err(PoolError::TooManyRequests { .. }) => return Ok(()),
            Err(e) => return Err(TestCaseError::fail(format!("open_with_prefix: {e}"))),
        };
        self.settle()?;
        let after = self.router.registered();
        for (i, (&h, &c)) in hs.iter().zip(&cached).enumerate() {
            prop_assert_eq!(c as usize % ps, 0, "a hit is whole pages");
            let c = c as usize / ps;
            let (prompt, salt) = &prompts[i];
            let (low, high) = (reachable[i], ideal.registered(&hashes[i]));
            let what = format!("prompt {i} {prompt:?} (salt {salt}) hit {c} pages");
            prop_assert!(c <= high, "{}, only {} registered", what, high);
            if self.host == 0 || room {
                prop_assert!(c >= low, "{} of the {} reachable", what, low);
            }
            // Each hit page is the device page registered under its hash.
            let pages = self.a.pages(h).unwrap();
            for j in 0..c {
                prop_assert_eq!(after.get(&hashes[i][j]).and_then(|x| x.0), Some(pages[j]));
            }
            self.reqs.insert(
                h,
                Req {
                    salt: *salt,
                    script: prompt.clone(),
                    published: c,
                },
            );
            self.order.push(h);
        }
        Ok(())
    }

    pub fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        let ps = self.ps;
        match op {
            Op::Open(spec) => self.open(&spec)?,
            Op::Extend(v, seed) => {
                self.rng ^= seed as u64;
                let mut todo = Vec::new();
                for (pick, n) in v {
                    if let Some(h) = self.pick(pick) {
                        todo.push((h, n as usize % (2 * ps + 2)));
                    }
                }
                self.extend(todo)?;
            }
            Op::Prefill(pick, out) => {
                let Some(h) = self.pick(pick) else {
                    return Ok(());
                };
                let left = self.reqs[&h]
                    .script
                    .len()
                    .saturating_sub(self.a.length(h).unwrap());
                self.extend(vec![(h, left + out as usize % (ps + 2))])?;
            }
            Op::Cache(pick, prio) => {
                let Some(h) = self.pick(pick) else {
                    return Ok(());
                };
                let intact = self.chain_intact(h);
                match prio {
                    None => self.a.cache(&[h]).unwrap(),
                    Some(p) => self
                        .a
                        .cache_with_priority(
                            &[h],
                            Counts::Each(PRIOS[p as usize % 4] as i64),
                            retain(p),
                        )
                        .unwrap(),
                }
                self.published(h);
                if intact {
                    self.settle()?;
                    self.chain_reachable(h)?;
                }
            }
            Op::Close(pick, cache, prio) => {
                let Some(h) = self.pick(pick) else {
                    return Ok(());
                };
                if cache {
                    let r = &self.reqs[&h];
                    let len = self.a.length(h).unwrap();
                    if len > 1 && self.history.len() < 12 {
                        self.history.push((r.script[..len].to_vec(), r.salt));
                    }
                }
                match prio {
                    Some(p) if cache => self
                        .a
                        .close_with_priority(
                            &[h],
                            Counts::Each(PRIOS[p as usize % 4] as i64),
                            retain(p),
                        )
                        .unwrap(),
                    _ => self.a.close(&[h], cache).unwrap(),
                }
                self.reqs.remove(&h);
            }
            Op::Fork(pick, n) => {
                let Some(h) = self.pick(pick) else {
                    return Ok(());
                };
                match self.a.fork(h, n as usize) {
                    Ok(kids) => {
                        for k in kids {
                            self.reqs.insert(k, self.reqs[&h].clone());
                            self.order.push(k);
                        }
                    }
                    Err(PoolError::TooManyRequests { .. }) => {}
                    Err(e) => return Err(TestCaseError::fail(format!("fork: {e}"))),
                }
            }
            Op::Truncate(pick, frac, diverge) => {
                let Some(h) = self.pick(pick) else {
                    return Ok(());
                };
                let len = self.a.length(h).unwrap();
                let to = len * frac as usize / 256;
                self.a.truncate(&[h], Counts::Each(to as i64)).unwrap();
                let r = self.reqs.get_mut(&h).unwrap();
                r.published = r.published.min(to / ps);
                // Only a request made shorter forgets its prompt from there.
                if diverge && to < len {
                    r.script.truncate(to);
                }
            }
            Op::Evict(n) => {
                self.a.evict(n as usize);
            }
            Op::Tick(s) => {
                self.now += s as f64 / 16.0;
                self.a.set_clock(self.now).unwrap();
            }
            Op::Unpin(pick) => {
                let Some(h) = self.pick(pick) else {
                    return Ok(());
                };
                self.a.unpin(&[h]).unwrap();
            }
        }
        self.settle()
    }

    /// One step: each request (once) computes `n` more tokens, its script's
    /// next ones (new outputs past its end). A full pool is no error.
    fn extend(&mut self, todo: Vec<(i64, usize)>) -> Result<(), TestCaseError> {
        let (mut hs, mut cs, mut toks) = (Vec::new(), Vec::new(), Vec::new());
        for (h, n) in todo {
            if hs.contains(&h) {
                continue;
            }
            let len = self.a.length(h).unwrap();
            let n = n.min(max_ctx(self.ps) - len);
            while self.reqs[&h].script.len() < len + n {
                let t = self.token();
                self.reqs.get_mut(&h).unwrap().script.push(t);
            }
            toks.extend(self.reqs[&h].script[len..len + n].iter().map(|&t| t as i64));
            hs.push(h);
            cs.push(n as i64);
        }
        match self.a.extend(&hs, Counts::PerRequest(&cs), Some(&toks)) {
            Ok(_) | Err(PoolError::Exhausted { .. }) => Ok(()),
            Err(e) => Err(TestCaseError::fail(format!("extend: {e}"))),
        }
    }

    /// The chain hashes of the pages request `h` published.
    fn published_hashes(&self, h: i64) -> Vec<u128> {
        let r = &self.reqs[&h];
        page_hashes(
            self.seed,
            self.ps,
            r.salt,
            &r.script[..r.published * self.ps],
        )
    }

    /// Whether every page request `h` published is registered on the
    /// request's own page, as the events tell: its chain so far is its own
    /// pages' registrations, which stay while it holds them, so its tip is
    /// live. (Not so for a page that duplicated a copy someone else held:
    /// that copy may be evicted since, taking the request's tip.)
    fn chain_intact(&self, h: i64) -> bool {
        let pages = self.a.pages(h).unwrap();
        let reg = self.router.registered();
        self.published_hashes(h)
            .iter()
            .zip(&pages)
            .all(|(x, &p)| reg.get(x).and_then(|y| y.0) == Some(p))
    }

    /// After `cache()` on an intact chain, a prompt of every page the
    /// request published hits them all (asked of a copy of the pool, so
    /// the trace goes on undisturbed): an orphan of the same content gave
    /// way to the request's page (no hash collision here). The events
    /// alone cannot tell: a page of the request's own that its chain
    /// links under a new parent registration (`relink`) reports nothing.
    fn chain_reachable(&self, h: i64) -> Result<(), TestCaseError> {
        let r = &self.reqs[&h];
        let n = r.published * self.ps;
        let mut prompt: Vec<i64> = r.script[..n].iter().map(|&t| t as i64).collect();
        prompt.push(0);
        // A hit leaves a prompt's last token to compute: at the context
        // limit, the last page is not asked for.
        prompt.truncate(self.a.max_context_len());
        let want = n.min((prompt.len() - 1) / self.ps * self.ps);
        let mut probe = self.a.clone();
        match probe.open_with_prefix(&prompt, &[prompt.len() as i64], Counts::Each(r.salt)) {
            Ok((_, cached)) => prop_assert_eq!(
                cached[0] as usize,
                want,
                "request {} cached {} tokens on an intact chain",
                h,
                n
            ),
            Err(PoolError::TooManyRequests { .. }) => {}
            Err(e) => return Err(TestCaseError::fail(format!("open_with_prefix: {e}"))),
        }
        Ok(())
    }

    /// `cache()` ran after the request's step: its full pages are published.
    fn published(&mut self, h: i64) {
        let len = self.a.length(h).unwrap();
        self.reqs.get_mut(&h).unwrap().published = len / self.ps;
    }
}

fn max_ctx(ps: usize) -> usize {
    10 * ps + 8
}

/// Some priorities last a while on the manual clock, the rest for good.
fn retain(p: u8) -> Option<f64> {
    (p & 4 != 0).then_some(4.0)
}
