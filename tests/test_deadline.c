/*
 * The agent's deadlines (agent/deadline.c): one heap and one libuv timer
 * for every running batch.  Items fire in the order they are due, none
 * before its time, a removed one never, an item removed or added by
 * another's fire is seen by the same timer run, and closing drops what is
 * left.  The batch semantics built on it (TIMEOUT results, cancel, abort)
 * are checked by test_agent, test_e2e_agent and test_faults*.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "agent_fixture.h"
#include "deadline.h"

#define N 64

typedef struct item {
  sx__dl_item it;
  uint64_t due;   /* the loop's time it was due */
  uint64_t fired; /* the loop's time it fired, 0 not yet */
  int order;
} item;

static item items[N];
static int fired_count;
static sx__dl *cur;

static void on_fire(sx__dl_item *it) {
  item *x = (item *)((char *)it - offsetof(item, it));
  assert_int_equal(it->idx, SIZE_MAX); /* out of the heap already */
  x->fired = uv_now(cur->timer.loop);
  x->order = fired_count++;
}

/* A loop with deadlines on it, and the items cleared. */
static void open_dl(uv_loop_t *loop, sx__dl *d) {
  uv_loop_init(loop);
  sx__dl_init(loop, d);
  memset(items, 0, sizeof(items));
}

/* Fires in order, never early; removed ones never fire; the heap's places
 * stay right through removals from its middle. */
static void test_deadline_order(void **state) {
  (void)state;
  uv_loop_t loop;
  sx__dl d;
  open_dl(&loop, &d);
  cur = &d;
  fired_count = 0;
  srand(7);
  uv_update_time(&loop);
  for (int i = 0; i < N; i++) {
    sx__dl_item_init(&items[i].it, on_fire);
    uint64_t ms = (uint64_t)(rand() % 40);
    items[i].due = uv_now(&loop) + ms;
    assert_int_equal(sx__dl_add(&d, &items[i].it, ms), 0);
  }
  /* Every fourth removed (from anywhere in the heap), one twice. */
  for (int i = 0; i < N; i += 4)
    sx__dl_remove(&d, &items[i].it);
  sx__dl_remove(&d, &items[0].it);
  assert_int_equal(d.n, N - N / 4);
  while (fired_count < N - N / 4)
    uv_run(&loop, UV_RUN_ONCE);
  for (int i = 0; i < N; i++) {
    if (i % 4 == 0) {
      assert_int_equal(items[i].fired, 0);
      continue;
    }
    assert_true(items[i].fired >= items[i].due);
    for (int j = 0; j < N; j++)
      if (j % 4 != 0 && items[j].order < items[i].order)
        assert_true(items[j].due <= items[i].due);
  }
  assert_int_equal(d.n, 0);
  sx__dl_close(&d);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* A fire that removes a later item and adds an earlier one than the rest:
 * the removed one never fires, the added one does, in its turn. */
static sx__dl *chain_d;
static int chain_step;

static void chain_fire(sx__dl_item *it) {
  item *x = (item *)((char *)it - offsetof(item, it));
  x->order = chain_step++;
  if (x == &items[0]) {
    sx__dl_remove(chain_d, &items[2].it);
    sx__dl_item_init(&items[3].it, chain_fire);
    assert_int_equal(sx__dl_add(chain_d, &items[3].it, 1), 0);
  }
}

static void test_deadline_changed_by_a_fire(void **state) {
  (void)state;
  uv_loop_t loop;
  sx__dl d;
  open_dl(&loop, &d);
  chain_d = &d;
  chain_step = 0;
  for (int i = 0; i < 4; i++)
    items[i].order = -1;
  sx__dl_item_init(&items[0].it, chain_fire);
  sx__dl_item_init(&items[1].it, chain_fire);
  sx__dl_item_init(&items[2].it, chain_fire);
  assert_int_equal(sx__dl_add(&d, &items[0].it, 1), 0);
  assert_int_equal(sx__dl_add(&d, &items[1].it, 30), 0);
  assert_int_equal(sx__dl_add(&d, &items[2].it, 20), 0);
  while (chain_step < 3)
    uv_run(&loop, UV_RUN_ONCE);
  assert_int_equal(items[0].order, 0);
  assert_int_equal(items[3].order, 1);
  assert_int_equal(items[1].order, 2);
  assert_int_equal(items[2].order, -1);
  /* Closed with one left: it never fires, and the loop has nothing open. */
  sx__dl_item_init(&items[2].it, chain_fire);
  assert_int_equal(sx__dl_add(&d, &items[2].it, 1), 0);
  sx__dl_close(&d);
  assert_int_equal(items[2].it.idx, SIZE_MAX);
  assert_int_not_equal(sx__dl_add(&d, &items[2].it, 1), 0);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(items[2].order, -1);
  assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_deadline_order),
      cmocka_unit_test(test_deadline_changed_by_a_fire),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
