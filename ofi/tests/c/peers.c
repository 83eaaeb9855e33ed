/* peers.c: peers that are not there. A message, a tagged message and an RMA write to an
 * endpoint that has closed, to a service no endpoint listens on, and to a NIC that is not
 * on the fabric: each ends (an error completion, or a negative errno at once), none hangs,
 * and the sender still reaches the peers that are there. Closing an endpoint with receives
 * posted discards them (fi_endpoint(3)).
 *
 * Usage: peers
 */
#include "ctest.h"

static struct ct_pair P;
static struct ct_side C; /* a third endpoint, on rb1, that stays */
static char *abuf, *bbuf, *cbuf;

/* The next entry of A's CQ is an error for `ctx`; its errno is returned (0: none). */
static int error_for(void *ctx)
{
	struct fi_cq_tagged_entry e;
	struct fi_cq_err_entry err = { 0 };
	ssize_t r = ct_read(P.a.cq, &e, NULL, 60);
	if (r != -FI_EAVAIL || fi_cq_readerr(P.a.cq, &err, 0) != 1) {
		fprintf(stderr, "peers.c: fi_cq_read gave %zd, not an error entry\n", r);
		return 0;
	}
	CHECK(err.op_context == ctx);
	return err.err;
}

/* A still reaches C. */
static void reaches_c(fi_addr_t c, unsigned seed)
{
	struct fi_cq_tagged_entry e;
	ct_fill(abuf, 100, seed);
	CHECK_EQ(fi_recv(C.ep, cbuf, 4096, NULL, FI_ADDR_UNSPEC, (void *)0xc1), 0);
	CHECK_EQ(fi_send(P.a.ep, abuf, 100, NULL, c, (void *)0xa1), 0);
	CHECK(ct_wait(P.a.cq, &e) && e.op_context == (void *)0xa1);
	CHECK(ct_wait(C.cq, &e) && e.op_context == (void *)0xc1 && e.len == 100);
	CHECK(ct_same(cbuf, 100, seed));
}

int main(void)
{
	ct_name = "peers";
	struct ct_opts o = { .caps = FI_MSG | FI_TAGGED | FI_RMA, .mr_local = 0 };
	struct fi_cq_tagged_entry e;
	struct fid_mr *bmr = NULL;
	fi_addr_t c, nobody, nowhere;
	char addr[64];

	ct_pair_open(&P, &o);
	ct_side_open(&P, &C, P.list->next, &o);
	abuf = ct_pages(1 << 20);
	bbuf = ct_pages(1 << 20);
	cbuf = ct_pages(1 << 20);
	REQUIRE(fi_av_insert(P.a.av, C.name, 1, &c, 0, NULL) == 1);

	/* Connected first: one message each way. */
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 64, NULL, FI_ADDR_UNSPEC, (void *)0xb1), 0);
	CHECK_EQ(fi_send(P.a.ep, abuf, 8, NULL, P.a.peer, (void *)0xa1), 0);
	CHECK(ct_wait(P.a.cq, &e));
	CHECK(ct_wait(P.b.cq, &e));
	REQUIRE(fi_mr_reg(P.b.dom, bbuf, 1 << 20, FI_REMOTE_WRITE, 0, 0, 0, &bmr, NULL) == 0);
	uint64_t key = fi_mr_key(bmr);

	/* B closes its endpoint with two receives posted: they are discarded, no entry. */
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 64, NULL, FI_ADDR_UNSPEC, (void *)0xb2), 0);
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 64, NULL, FI_ADDR_UNSPEC, 5, 0, (void *)0xb3), 0);
	CHECK_EQ(fi_close(&P.b.ep->fid), 0);
	CHECK(ct_quiet(P.b.cq));

	/* Sends to it end in error completions (the provider gives FI_EIO). */
	CHECK_EQ(fi_send(P.a.ep, abuf, 8, NULL, P.a.peer, (void *)0xa2), 0);
	CHECK_EQ(error_for((void *)0xa2), FI_EIO);
	CHECK_EQ(fi_tsend(P.a.ep, abuf, 8, NULL, P.a.peer, 5, (void *)0xa3), 0);
	CHECK_EQ(error_for((void *)0xa3), FI_EIO);
	CHECK_EQ(fi_tsend(P.a.ep, abuf, 50000, NULL, P.a.peer, 5, (void *)0xa4), 0);
	CHECK_EQ(error_for((void *)0xa4), FI_EIO);
	/* Its memory region is still registered: what a write gives is not the point, that
	 * it ends is. */
	CHECK_EQ(fi_write(P.a.ep, abuf, 64, NULL, P.a.peer, (uint64_t)(uintptr_t)bbuf, key,
			  (void *)0xa5),
		 0);
	ssize_t r = ct_read(P.a.cq, &e, NULL, 60);
	CHECK(r == 1 || r == -FI_EAVAIL);
	if (r == -FI_EAVAIL) {
		struct fi_cq_err_entry err;
		CHECK_EQ(fi_cq_readerr(P.a.cq, &err, 0), 1);
	}
	reaches_c(c, 1);

	/* A service no endpoint listens on, at B's NIC: the connection is refused. */
	memcpy(addr, C.name, C.namelen);
	addr[15] ^= 0x55;
	REQUIRE(fi_av_insert(P.a.av, addr, 1, &nobody, 0, NULL) == 1);
	CHECK_EQ(fi_send(P.a.ep, abuf, 8, NULL, nobody, (void *)0xa6), 0);
	int err = error_for((void *)0xa6);
	CHECK(err != 0);
	fprintf(stderr, "peers.c: a send to a service nobody listens on: %d (%s)\n", err,
		fi_strerror(err));
	CHECK_EQ(fi_tsend(P.a.ep, abuf, 8, NULL, nobody, 5, (void *)0xa7), 0);
	CHECK(error_for((void *)0xa7) != 0);
	reaches_c(c, 2);

	/* A NIC address that is not on the fabric: refused at once. */
	memcpy(addr, C.name, C.namelen);
	addr[4] ^= 0x40;
	addr[7] ^= 0x3c;
	REQUIRE(fi_av_insert(P.a.av, addr, 1, &nowhere, 0, NULL) == 1);
	r = fi_send(P.a.ep, abuf, 8, NULL, nowhere, (void *)0xa8);
	if (r == 0)
		CHECK(error_for((void *)0xa8) != 0);
	else
		CHECK_EQ(r, -FI_EHOSTUNREACH);
	reaches_c(c, 3);
	CHECK(ct_quiet(P.a.cq));

	CHECK_EQ(fi_close(&bmr->fid), 0);
	ct_side_close(&C);
	CHECK_EQ(fi_close(&P.a.ep->fid), 0);
	CHECK_EQ(fi_close(&P.a.av->fid), 0);
	CHECK_EQ(fi_close(&P.a.cq->fid), 0);
	CHECK_EQ(fi_close(&P.a.dom->fid), 0);
	CHECK_EQ(fi_close(&P.b.av->fid), 0);
	CHECK_EQ(fi_close(&P.b.cq->fid), 0);
	CHECK_EQ(fi_close(&P.b.dom->fid), 0);
	CHECK_EQ(fi_close(&P.fab->fid), 0);
	fi_freeinfo(P.list);
	return ct_summary_exit();
}
