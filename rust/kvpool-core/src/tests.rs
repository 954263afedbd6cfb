//! Unit tests of the core; the property test against a model is in tests/.
use crate::*;

fn alloc(pages: usize, ps: usize) -> SlotAllocator {
    SlotAllocator::new(pages, ps, 4, 64).expect("valid config")
}

#[test]
fn fresh_pool_hands_out_pages_in_order_and_skips_page_0() {
    let mut a = alloc(8, 1);
    let h = a.open(1).unwrap();
    assert_eq!(a.extend(&h, Counts::Each(3)).unwrap(), vec![1, 2, 3]);
    assert_eq!(a.free_pages(), 4);
    a.check().unwrap();
}
