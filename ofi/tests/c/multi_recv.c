/* multi_recv.c: multi-receive buffers (FI_MULTI_RECV, fi_msg(3)) between two endpoints of
 * one process: messages packed one after another into one posted buffer, the completion
 * that leaves less than FI_OPT_MIN_MULTI_RECV bytes free carrying FI_MULTI_RECV, receives
 * posted after a multi-receive buffer taking messages only once it is released, two such
 * buffers filled in turn (the flag from fi_recvmsg and from the endpoint's default
 * operation flags), a message too long for what is left, fi_getinfo's operation flags,
 * fi_getopt/fi_setopt, and bad input.
 *
 * Usage: multi_recv local|nolocal
 */
#include "ctest.h"

static struct ct_pair P;
static int local;
static char *abuf, *bbuf;
static struct fid_mr *amr, *bmr;
#define BUFLEN ((size_t)1 << 20)

static void *adesc(void)
{
	return local ? fi_mr_desc(amr) : NULL;
}

static void *bdesc(void)
{
	return local ? fi_mr_desc(bmr) : NULL;
}

static void set_min(size_t min)
{
	CHECK_EQ(fi_setopt(&P.b.ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &min,
			   sizeof(min)),
		 0);
}

/* Posts `len` bytes of B's buffer at `off` as a multi-receive buffer with fi_recvmsg. */
static void post_multi(size_t off, size_t len, void *ctx)
{
	struct iovec iov = { .iov_base = bbuf + off, .iov_len = len };
	void *desc = bdesc();
	struct fi_msg m = { .msg_iov = &iov, .desc = &desc, .iov_count = 1,
			    .addr = FI_ADDR_UNSPEC, .context = ctx };
	CHECK_EQ(fi_recvmsg(P.b.ep, &m, FI_MULTI_RECV), 0);
}

/* Sends `len` bytes of pattern `seed` from A to B and reads the send's completion. */
static void send_one(size_t len, unsigned seed)
{
	struct fi_cq_tagged_entry e;
	ct_fill(abuf, len, seed);
	CHECK_EQ(fi_send(P.a.ep, abuf, len, adesc(), P.a.peer, (void *)0xa1), 0);
	CHECK(ct_wait(P.a.cq, &e) && e.op_context == (void *)0xa1);
}

/* B's next receive completion: context, flags, length, where the message landed (offset
 * `off` of B's buffer) and its bytes (pattern `seed`). */
static void expect_at(void *ctx, uint64_t flags, size_t len, size_t off, unsigned seed)
{
	struct fi_cq_tagged_entry e;
	if (!ct_wait(P.b.cq, &e)) {
		CHECK(!"a receive completion");
		return;
	}
	CHECK(e.op_context == ctx);
	CHECK_EQ(e.flags, flags);
	CHECK_EQ(e.len, len);
	CHECK(e.buf == bbuf + off);
	CHECK(ct_same(bbuf + off, len, seed));
}

static void options(void)
{
	size_t v = 0, len = sizeof(v);
	/* The default, then a value set. */
	CHECK_EQ(fi_getopt(&P.b.ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &v, &len), 0);
	CHECK_EQ(len, sizeof(size_t));
	CHECK_EQ(v, 64);
	set_min(300);
	v = 0;
	CHECK_EQ(fi_getopt(&P.b.ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &v, &len), 0);
	CHECK_EQ(v, 300);
	/* Too small a value buffer: -FI_ETOOSMALL, with the size needed. */
	uint32_t small = 0;
	len = sizeof(small);
	CHECK_EQ(fi_getopt(&P.b.ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &small, &len),
		 -FI_ETOOSMALL);
	CHECK_EQ(len, sizeof(size_t));
	/* A value of the wrong size, a NULL value, other options and levels. */
	CHECK_EQ(fi_setopt(&P.b.ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &small,
			   sizeof(small)),
		 -FI_EINVAL);
	CHECK_EQ(fi_setopt(&P.b.ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, NULL,
			   sizeof(size_t)),
		 -FI_EINVAL);
	CHECK_EQ(fi_setopt(&P.b.ep->fid, FI_OPT_ENDPOINT, FI_OPT_CM_DATA_SIZE, &v, sizeof(v)),
		 -FI_ENOPROTOOPT);
	CHECK_EQ(fi_setopt(&P.b.ep->fid, FI_OPT_ENDPOINT + 1, FI_OPT_MIN_MULTI_RECV, &v,
			   sizeof(v)),
		 -FI_ENOPROTOOPT);
	len = sizeof(v);
	CHECK_EQ(fi_getopt(&P.b.ep->fid, FI_OPT_ENDPOINT, FI_OPT_CM_DATA_SIZE, &v, &len),
		 -FI_ENOPROTOOPT);
}

/* Three messages packed into one buffer; the third leaves less than the minimum and
 * releases it. A receive posted after the buffer (before any message) takes the fourth
 * message, not the first. */
static void packed_then_behind(void)
{
	set_min(256);
	post_multi(0, 1000, (void *)0xb1);
	CHECK_EQ(fi_recv(P.b.ep, bbuf + 4096, 500, bdesc(), FI_ADDR_UNSPEC, (void *)0xb2), 0);
	send_one(300, 1);
	expect_at((void *)0xb1, FI_RECV | FI_MSG, 300, 0, 1);
	send_one(300, 2);
	expect_at((void *)0xb1, FI_RECV | FI_MSG, 300, 300, 2);
	send_one(300, 3);
	expect_at((void *)0xb1, FI_RECV | FI_MSG | FI_MULTI_RECV, 300, 600, 3);
	send_one(200, 4);
	expect_at((void *)0xb2, FI_RECV | FI_MSG, 200, 4096, 4);
	CHECK(ct_quiet(P.b.cq));
	/* The bytes after the last message are untouched. */
	CHECK_EQ(bbuf[900], 0);
}

/* Two buffers posted back to back with fi_recv and the endpoint's default flags
 * FI_MULTI_RECV: the first is filled and released before the second takes anything, and
 * with a minimum of 0 a buffer is released once full. Sends posted all at once. */
static void two_in_turn(void)
{
	uint64_t f = FI_RECV | FI_MULTI_RECV;
	CHECK_EQ(fi_control(&P.b.ep->fid, FI_SETOPSFLAG, &f), 0);
	set_min(0);
	memset(bbuf, 0, 8192);
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 512, bdesc(), FI_ADDR_UNSPEC, (void *)0xc1), 0);
	CHECK_EQ(fi_recv(P.b.ep, bbuf + 1024, 512, bdesc(), FI_ADDR_UNSPEC, (void *)0xc2), 0);
	f = FI_RECV;
	CHECK_EQ(fi_control(&P.b.ep->fid, FI_SETOPSFLAG, &f), 0);
	for (int i = 0; i < 8; i++) {
		ct_fill(abuf + i * 128, 128, 10 + i);
		CHECK_EQ(fi_send(P.a.ep, abuf + i * 128, 128, adesc(), P.a.peer, (void *)0xa2), 0);
	}
	for (int i = 0; i < 8; i++) {
		void *ctx = i < 4 ? (void *)0xc1 : (void *)0xc2;
		size_t off = (i < 4 ? 0 : 1024) + (size_t)(i % 4) * 128;
		uint64_t flags = FI_RECV | FI_MSG | (i % 4 == 3 ? FI_MULTI_RECV : 0);
		expect_at(ctx, flags, 128, off, 10 + i);
	}
	struct fi_cq_tagged_entry e;
	for (int i = 0; i < 8; i++)
		CHECK(ct_wait(P.a.cq, &e) && e.op_context == (void *)0xa2);
	CHECK(ct_quiet(P.b.cq));
}

/* A message longer than what is left: it fills the rest, completes in error FI_ETRUNC
 * with the bytes cut off, and releases the buffer. */
static void truncated(void)
{
	struct fi_cq_err_entry err;
	set_min(16);
	memset(bbuf, 0, 4096);
	post_multi(0, 200, (void *)0xd1);
	send_one(150, 20);
	expect_at((void *)0xd1, FI_RECV | FI_MSG, 150, 0, 20);
	send_one(100, 21);
	REQUIRE(ct_wait_err(P.b.cq, &err));
	CHECK_EQ(err.err, FI_ETRUNC);
	CHECK(err.op_context == (void *)0xd1);
	CHECK_EQ(err.flags, FI_RECV | FI_MSG | FI_MULTI_RECV);
	CHECK_EQ(err.len, 50);
	CHECK_EQ(err.olen, 50);
	CHECK(err.buf == bbuf + 150);
	CHECK(ct_same(bbuf + 150, 50, 21));
	CHECK_EQ(bbuf[200], 0);
	/* The connection carries the next message to a plain receive. */
	CHECK_EQ(fi_recv(P.b.ep, bbuf + 1024, 64, bdesc(), FI_ADDR_UNSPEC, (void *)0xd2), 0);
	send_one(64, 22);
	expect_at((void *)0xd2, FI_RECV | FI_MSG, 64, 1024, 22);
}

/* fi_getinfo: FI_MULTI_RECV is a receive-side operation flag, not a transmit one. */
static void info(void)
{
	struct fi_info *h = ct_hints(FI_MSG | FI_MULTI_RECV, local), *got = NULL;
	h->rx_attr->op_flags = FI_MULTI_RECV;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &got), 0);
	if (got) {
		CHECK(got->caps & FI_MULTI_RECV);
		CHECK(got->rx_attr->op_flags & FI_MULTI_RECV);
		fi_freeinfo(got);
	}
	got = NULL;
	h->rx_attr->op_flags = 0;
	h->tx_attr->op_flags = FI_MULTI_RECV;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &got), -FI_ENODATA);
	fi_freeinfo(h);
}

static void bad_input(void)
{
	struct iovec iov[2] = { { .iov_base = bbuf, .iov_len = 64 },
				{ .iov_base = bbuf + 64, .iov_len = 64 } };
	void *desc[2] = { bdesc(), bdesc() };
	struct fi_msg m = { .msg_iov = iov, .desc = desc, .iov_count = 2,
			    .addr = FI_ADDR_UNSPEC, .context = (void *)0xe1 };
	/* One buffer only, and not an empty one. */
	CHECK_EQ(fi_recvmsg(P.b.ep, &m, FI_MULTI_RECV), -FI_EINVAL);
	m.iov_count = 1;
	iov[0].iov_len = 0;
	CHECK_EQ(fi_recvmsg(P.b.ep, &m, FI_MULTI_RECV), -FI_EINVAL);
	CHECK(ct_quiet(P.b.cq));
}

int main(int argc, char **argv)
{
	static char name[64];
	if (argc < 2) {
		fprintf(stderr, "usage: multi_recv local|nolocal\n");
		return 2;
	}
	local = strcmp(argv[1], "local") == 0;
	snprintf(name, sizeof(name), "multi_recv %s", argv[1]);
	ct_name = name;

	struct ct_opts o = { .caps = FI_MSG | FI_MULTI_RECV, .mr_local = local };
	ct_pair_open(&P, &o);
	CHECK(P.list->caps & FI_MULTI_RECV);
	ct_pair_bufs(&P, local, BUFLEN, &abuf, &bbuf, &amr, &bmr);
	info();
	options();
	packed_then_behind();
	two_in_turn();
	truncated();
	bad_input();
	ct_pair_bufs_close(local, amr, bmr);
	ct_pair_close(&P);
	return ct_summary_exit();
}
