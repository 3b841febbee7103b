/*
 * Batch completion as a counter (agent/op.c): sx__op_xfers_done, which
 * cuda_ipc uses to settle a whole op whose copies ended together, settles
 * exactly what one sx__op_xfer_done per pending range would: ranges
 * settled before keep their status and are not counted again, bytes count
 * only on success, the first error and its message stick, and done runs
 * once, at zero.
 */
#include <stdio.h>
#include <string.h>

#include "agent_fixture.h"
#include "transport/transport.h"

#define N 8

typedef struct fixture {
  sx_xfer x[N];
  sx_op op;
  int done;
} fixture;

static void on_done(sx_op *op) { ((fixture *)op->owner)->done++; }

static void setup(fixture *f) {
  memset(f, 0, sizeof(*f));
  for (int i = 0; i < N; i++)
    f->x[i] = (sx_xfer){.length = 100u + (uint64_t)i, .status = 1};
  f->op = (sx_op){.xfers = f->x, .n = N, .pending = N, .done = on_done, .owner = f};
}

/* The same op settled range by range, for comparison. */
static void settle_each(fixture *f, int status, const char *msg) {
  for (size_t i = 0; i < N; i++)
    sx__op_xfer_done(&f->op, i, status, msg);
}

static void test_all_succeed(void **state) {
  (void)state;
  fixture a, b;
  setup(&a);
  setup(&b);
  sx__op_xfers_done(&a.op, 0, NULL);
  settle_each(&b, 0, NULL);
  assert_int_equal(a.done, 1);
  assert_int_equal(a.op.pending, 0);
  assert_int_equal(a.op.bytes, b.op.bytes);
  assert_int_equal(a.op.bytes, 8 * 100 + 28);
  assert_int_equal(a.op.first_error, 0);
  for (int i = 0; i < N; i++)
    assert_int_equal(a.x[i].status, 0);
  /* Nothing is pending any more: a late call settles nothing. */
  sx__op_xfers_done(&a.op, SX_EIO, "late");
  assert_int_equal(a.done, 1);
  assert_int_equal(a.op.first_error, 0);
}

static void test_some_settled_before(void **state) {
  (void)state;
  fixture f;
  setup(&f);
  sx__op_xfer_done(&f.op, 2, SX_EBOUNDS, "range 2 outside");
  sx__op_xfer_done(&f.op, 5, 0, NULL);
  assert_int_equal(f.op.pending, N - 2);
  sx__op_xfers_done(&f.op, 0, NULL);
  assert_int_equal(f.done, 1);
  assert_int_equal(f.op.pending, 0);
  assert_int_equal(f.x[2].status, SX_EBOUNDS); /* kept */
  assert_int_equal(f.op.bytes, 8 * 100 + 28 - 102); /* range 5 counted once */
  assert_int_equal(f.op.first_error, SX_EBOUNDS);
  assert_string_equal(f.op.message, "range 2 outside");
}

static void test_error_sticks(void **state) {
  (void)state;
  fixture f;
  setup(&f);
  sx__op_xfer_done(&f.op, 0, 0, NULL);
  sx__op_xfers_done(&f.op, SX_ECANCELED, NULL);
  assert_int_equal(f.done, 1);
  assert_int_equal(f.op.bytes, 100); /* only the range that arrived */
  assert_int_equal(f.op.first_error, SX_ECANCELED);
  assert_string_equal(f.op.message, sx_strerror(SX_ECANCELED));
  for (int i = 1; i < N; i++)
    assert_int_equal(f.x[i].status, SX_ECANCELED);

  /* A first error recorded earlier is not replaced. */
  setup(&f);
  sx__op_xfer_done(&f.op, 7, SX_EIO, "first");
  sx__op_xfers_done(&f.op, SX_ETIMEDOUT, "second");
  assert_int_equal(f.op.first_error, SX_EIO);
  assert_string_equal(f.op.message, "first");
  assert_int_equal(f.done, 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_all_succeed),
      cmocka_unit_test(test_some_settled_before),
      cmocka_unit_test(test_error_sticks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
