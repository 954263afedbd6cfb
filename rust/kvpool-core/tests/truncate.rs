//! Truncating into a prompt: the request forgets its prompt past the new
//! length, so it can diverge from it (an edited message, a retried tool
//! call, a rejected speculative tail), and registration follows the tokens
//! it actually holds.

use kvpool_core::{Counts, PoolError};

mod common;

use common::{pool, seq};

fn ids(v: &[i64]) -> Vec<i32> {
    v.iter().map(|&t| t as i32).collect()
}

#[test]
fn a_request_truncated_into_its_prompt_takes_other_tokens() {
    let mut a = pool(32, 4);
    let prompt = seq(10, 100);
    let (h, _) = a.open_with_prefix(&prompt, &[10], Counts::Each(0)).unwrap();
    a.extend(&h, Counts::Each(8), None).unwrap();
    a.truncate(&h, Counts::Each(3)).unwrap();
    // Position 3 was the prompt's 103; the request now takes 7.
    a.extend(&h, Counts::Each(1), Some(&[7])).unwrap();
    assert_eq!(a.known_tokens(h[0]).unwrap(), vec![100, 101, 102, 7]);
    // Positions past the new end without ids are unknown, not the prompt's.
    a.extend(&h, Counts::Each(2), None).unwrap();
    assert_eq!(a.known_tokens(h[0]).unwrap().len(), 4);
    assert_eq!(a.length(h[0]), Ok(6));
    a.check().unwrap();
}

#[test]
fn truncating_to_the_current_length_keeps_the_prompt() {
    let mut a = pool(32, 4);
    let prompt = seq(10, 100);
    let (h, _) = a.open_with_prefix(&prompt, &[10], Counts::Each(0)).unwrap();
    a.truncate(&h, Counts::Each(0)).unwrap();
    a.extend(&h, Counts::Each(5), None).unwrap();
    a.truncate(&h, Counts::Each(5)).unwrap();
    a.extend(&h, Counts::Each(5), None).unwrap();
    assert_eq!(a.known_tokens(h[0]).unwrap(), ids(&prompt));
    // Still bound by its prompt: a disagreeing id is refused.
    let (h, _) = a.open_with_prefix(&prompt, &[10], Counts::Each(0)).unwrap();
    a.extend(&h, Counts::Each(4), None).unwrap();
    a.truncate(&h, Counts::Each(4)).unwrap();
    let e = a.extend(&h, Counts::Each(1), Some(&[7]));
    assert!(matches!(e, Err(PoolError::InvalidArgument(_))), "{e:?}");
    a.check().unwrap();
}

#[test]
fn a_diverged_request_registers_its_new_tokens() {
    let mut a = pool(32, 4);
    let old = seq(12, 100);
    let (h, _) = a.open_with_prefix(&old, &[12], Counts::Each(0)).unwrap();
    a.extend(&h, Counts::Each(12), None).unwrap();
    a.cache(&h).unwrap();
    assert_eq!(a.cached_pages(), 3);
    // Back to position 6 (inside page 1), then other tokens to 12.
    a.truncate(&h, Counts::Each(6)).unwrap();
    let new_tail = seq(6, 200);
    a.extend(&h, Counts::Each(6), Some(&new_tail)).unwrap();
    let diverged = [old[..6].to_vec(), new_tail].concat();
    assert_eq!(a.known_tokens(h[0]).unwrap(), ids(&diverged));
    a.cache(&h).unwrap();
    a.close(&h, false).unwrap();
    a.check().unwrap();
    // The diverged prompt hits all three of its pages...
    let (_, c) = a
        .open_with_prefix(
            &[diverged.clone(), vec![1]].concat(),
            &[13],
            Counts::Each(0),
        )
        .unwrap();
    assert_eq!(c, vec![12]);
    // ...and the old one only the page before the truncation point.
    let (_, c) = a
        .open_with_prefix(&[old.clone(), vec![1]].concat(), &[13], Counts::Each(0))
        .unwrap();
    assert_eq!(c, vec![4]);
    a.check().unwrap();
}

#[test]
fn a_fork_truncated_into_the_prompt_diverges_alone() {
    // Speculative decoding over a prompt tail: the draft is a fork.
    let mut a = pool(32, 4);
    let prompt = seq(8, 100);
    let (h, _) = a.open_with_prefix(&prompt, &[8], Counts::Each(0)).unwrap();
    a.extend(&h, Counts::Each(6), None).unwrap();
    let k = a.fork(h[0], 1).unwrap();
    a.truncate(&k, Counts::Each(5)).unwrap();
    a.extend(&k, Counts::Each(2), Some(&[9, 9])).unwrap();
    let _ = a.take_copies();
    // The parent still follows its prompt.
    a.extend(&h, Counts::Each(2), None).unwrap();
    assert_eq!(a.known_tokens(h[0]).unwrap(), ids(&prompt));
    assert_eq!(
        a.known_tokens(k[0]).unwrap(),
        vec![100, 101, 102, 103, 104, 9, 9]
    );
    a.check().unwrap();
}

#[test]
fn rolling_back_an_extend_keeps_the_prompt() {
    // An extend whose step never ran (the caller's table update failed) is
    // given back: the positions are still the prompt's.
    let mut a = pool(32, 4);
    let prompt = seq(10, 100);
    let (h, _) = a.open_with_prefix(&prompt, &[10], Counts::Each(0)).unwrap();
    a.extend(&h, Counts::Each(2), None).unwrap();
    let free = a.free_pages();
    a.extend(&h, Counts::Each(8), None).unwrap();
    a.roll_back_extend(&h, Counts::Each(2)).unwrap();
    assert_eq!((a.length(h[0]), a.free_pages()), (Ok(2), free));
    assert_eq!(a.known_tokens(h[0]).unwrap(), ids(&prompt[..2]));
    a.check().unwrap();
    // The retry takes the prompt's ids again, and disagreeing ones are refused.
    let e = a.extend(&h, Counts::Each(1), Some(&[7]));
    assert!(matches!(e, Err(PoolError::InvalidArgument(_))), "{e:?}");
    a.extend(&h, Counts::Each(8), None).unwrap();
    assert_eq!(a.known_tokens(h[0]).unwrap(), ids(&prompt));
    // Its errors are truncate's, and leave the request as it was.
    let e = a.roll_back_extend(&h, Counts::Each(11));
    assert!(matches!(e, Err(PoolError::InvalidArgument(_))), "{e:?}");
    assert_eq!(a.length(h[0]), Ok(10));
    a.check().unwrap();
}
