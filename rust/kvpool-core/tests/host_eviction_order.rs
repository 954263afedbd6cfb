//! The host tier evicts a chain's tail before its parents, as the device
//! does: a host eviction that took a chain's first page would leave every
//! page after it unreachable (a hit walks from the first page), so one lost
//! page would cost the whole prefix. Whatever put the chain on the host
//! (write_back offloads of device victims, write_through offloads of
//! `cache()`, loads of a host hit), the oldest host page is its tail.

use kvpool_core::{Counts, HostPolicy, Options, SlotAllocator};

/// 11 usable device pages of 4 tokens, 5 usable host pages.
fn pool(policy: HostPolicy) -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(1),
        host_pages: 6,
        host_policy: policy,
        ..Options::new()
    };
    SlotAllocator::with_options(12 * 4, 4, 8, 64, opts).unwrap()
}

/// Opens `prompt` on its cached prefix, extends it to its end, closes it
/// with `cache=True`, evicts every device page and runs the transfers, as
/// a caller of the pool does; returns the tokens the open found cached.
fn serve_and_push_to_host(a: &mut SlotAllocator, prompt: &[i64]) -> usize {
    let cached = serve(a, prompt, true);
    a.evict(100);
    a.take_offloads();
    a.take_loads();
    a.check().unwrap();
    cached
}

fn serve(a: &mut SlotAllocator, prompt: &[i64], close: bool) -> usize {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    let c = cached[0] as usize;
    a.extend(
        &h,
        Counts::Each((prompt.len() - c) as i64),
        Some(&prompt[c..]),
    )
    .unwrap();
    a.take_offloads();
    a.take_loads();
    if close {
        a.close(&h, true).unwrap();
        a.take_offloads();
    }
    c
}

#[test]
fn one_host_eviction_takes_a_chains_tail_not_its_first_page() {
    let chain: Vec<i64> = (100..117).collect(); // 4 full pages and one token
    let other: Vec<i64> = (500..509).collect(); // 2 full pages: one host page must go
    for policy in [HostPolicy::WriteBack, HostPolicy::WriteThrough] {
        for hit_from_host_first in [false, true] {
            let mut a = pool(policy);
            serve_and_push_to_host(&mut a, &chain);
            if hit_from_host_first {
                assert_eq!(
                    serve_and_push_to_host(&mut a, &chain),
                    16,
                    "{policy:?}: a host hit"
                );
            }
            serve_and_push_to_host(&mut a, &other);
            assert_eq!(
                serve(&mut a, &chain, false),
                12,
                "{policy:?}, hit from the host first: {hit_from_host_first}: the chain lost its tail only"
            );
            a.check().unwrap();
        }
    }
}
