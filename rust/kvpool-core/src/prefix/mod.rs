//! The prefix index: which registered page holds which content, and the
//! token ids of every slot, so that a hit is verified before it is served.
//!
//! - `hashing.rs`: the chain hash `h_i = H(seed, h_{i-1}, tokens of page i)`;
//! - `keys.rs`, `key_table.rs`: the lookup key of a hash and its table;
//! - `index.rs`: the entries and their verification;
//! - `tokens.rs`: every slot's token ids and the chain hashes of pages;
//! - `register.rs`: filing, relinking and removing entries;
//! - `ghosts.rs`: what a removed entry with children leaves behind, so
//!   that recomputing its content revives its chain (`ghost_table.rs`:
//!   the maps that keep them);
//! - `links.rs`: which entries the key table files (a chain's only
//!   children are reached through their parents' hints), and the
//!   parent-child counts behind it;
//! - `runs.rs`: stretches of entries filed one under another, whose tokens
//!   and pages sit side by side for a page-size-1 walk (`run_builder.rs`:
//!   how a registration pass records one);
//! - `lookup.rs`: walking a prompt's or a sent chain's pages through it;
//! - `tip.rs`: where a chain stands (shared with the requests);
//! - `tiers.rs`: where each entry's bytes are (device page, host copy).
//!
//! The index keeps no page state: a page's record (`pages/`) names its
//! entry, and the allocator keeps the two in step.

mod check;
mod ghost_table;
mod ghosts;
pub(crate) mod hashing;
pub(crate) mod index;
mod key_table;
mod keys;
mod links;
mod lookup;
mod register;
pub(crate) mod run_builder;
mod runs;
pub(crate) mod tiers;
pub(crate) mod tip;
mod tokens;
