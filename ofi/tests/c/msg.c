/* msg.c: untagged messages between two endpoints of one process (rb0 and rb1):
 * fi_send/recv, sendv/recvv, sendmsg/recvmsg, senddata/injectdata, inject, sizes from 0
 * bytes to 1 MiB, the completion entries of the CQ format given, fi_cq_readfrom, selective
 * completion, and bad input (addresses out of the AV, descriptors that are not regions,
 * oversized injects, NULL messages).
 *
 * Usage: msg local|nolocal context|msg|data|tagged [selective|map|sread]
 *   local: FI_MR_LOCAL in the hints, every buffer registered and its descriptor passed;
 *   nolocal: no mode bit, no descriptor (the provider registers itself).
 *   selective: the CQs are bound with FI_SELECTIVE_COMPLETION.
 *   map: FI_AV_MAP address vectors instead of FI_AV_TABLE.
 *   sread: CQs with a wait object (FI_WAIT_UNSPEC), completions waited for with
 *   fi_cq_sread/fi_cq_sreadfrom.
 *   source: FI_SOURCE asked for: every receive names its sender.
 */
#include "ctest.h"

static struct ct_pair P;
static int local;
static enum fi_cq_format fmt;
static int sread;
static int source;
static char *abuf, *bbuf; /* each side's buffers, 2 MiB + a page each */
static struct fid_mr *amr, *bmr;
#define BUFLEN ((size_t)(2 << 20) + 4096)

static void *adesc(void)
{
	return local ? fi_mr_desc(amr) : NULL;
}

static void *bdesc(void)
{
	return local ? fi_mr_desc(bmr) : NULL;
}

/* One completion as the fields of the CQ's format allow: the tagged entry view of what
 * was read (fields beyond the format zero). */
static int wait_entry(struct fid_cq *cq, struct fi_cq_tagged_entry *out, fi_addr_t *src)
{
	union {
		struct fi_cq_entry c;
		struct fi_cq_msg_entry m;
		struct fi_cq_data_entry d;
		struct fi_cq_tagged_entry t;
		char guard[sizeof(struct fi_cq_tagged_entry) + 16];
	} u;
	size_t size = fmt == FI_CQ_FORMAT_CONTEXT ? sizeof(u.c)
		      : fmt == FI_CQ_FORMAT_MSG	  ? sizeof(u.m)
		      : fmt == FI_CQ_FORMAT_DATA  ? sizeof(u.d)
						  : sizeof(u.t);
	memset(&u, 0xa5, sizeof(u));
	ssize_t r;
	if (sread) {
		/* Blocks (the provider polls) until an entry comes, at most 30 s. */
		r = src ? fi_cq_sreadfrom(cq, &u, 1, src, NULL, 30000)
			: fi_cq_sread(cq, &u, 1, NULL, 30000);
	} else {
		r = ct_read(cq, &u, src, 30);
	}
	if (r != 1) {
		fprintf(stderr, "wait_entry: %zd (%s)\n", r, r < 0 ? fi_strerror((int)-r) : "");
		return 0;
	}
	/* The provider writes exactly one entry of the format's size. */
	CHECK_EQ((unsigned char)u.guard[size], 0xa5);
	memset(out, 0, sizeof(*out));
	memcpy(out, &u, size);
	return 1;
}

/* A completion for `ctx` with `flags` (and, where the format has them, `len`, `data`). */
static void expect(struct fid_cq *cq, void *ctx, uint64_t flags, size_t len, uint64_t data)
{
	struct fi_cq_tagged_entry e;
	if (!wait_entry(cq, &e, NULL)) {
		CHECK(!"a completion");
		return;
	}
	CHECK(e.op_context == ctx);
	if (fmt == FI_CQ_FORMAT_CONTEXT)
		return;
	CHECK_EQ(e.flags, flags);
	if (flags & FI_RECV)
		CHECK_EQ(e.len, len);
	if (fmt != FI_CQ_FORMAT_MSG && (flags & FI_REMOTE_CQ_DATA))
		CHECK_EQ(e.data, data);
}

/* A message of `len` bytes from A to B, the receive posted first; data checked. */
static void one_way(size_t len, unsigned seed)
{
	memset(bbuf, 0, len + 16);
	ct_fill(abuf, len, seed);
	CHECK_EQ(fi_recv(P.b.ep, bbuf, len + 16, bdesc(), FI_ADDR_UNSPEC, (void *)0xb1), 0);
	CHECK_EQ(fi_send(P.a.ep, abuf, len, adesc(), P.a.peer, (void *)0xa1), 0);
	expect(P.a.cq, (void *)0xa1, FI_SEND | FI_MSG, 0, 0);
	expect(P.b.cq, (void *)0xb1, FI_RECV | FI_MSG, len, 0);
	CHECK(ct_same(bbuf, len, seed));
	CHECK_EQ(bbuf[len], 0);
}

static void sizes(void)
{
	static const size_t lens[] = { 0, 1, 64, 236, 237, 4096, 65536, 1 << 20 };
	for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++)
		one_way(lens[i], (unsigned)i + 1);
	/* Zero bytes from and into no buffer at all. */
	CHECK_EQ(fi_recv(P.b.ep, NULL, 0, NULL, FI_ADDR_UNSPEC, (void *)0xb9), 0);
	CHECK_EQ(fi_send(P.a.ep, NULL, 0, NULL, P.a.peer, (void *)0xa9), 0);
	expect(P.a.cq, (void *)0xa9, FI_SEND | FI_MSG, 0, 0);
	expect(P.b.cq, (void *)0xb9, FI_RECV | FI_MSG, 0, 0);
	CHECK_EQ(fi_recv(P.b.ep, NULL, 0, NULL, FI_ADDR_UNSPEC, (void *)0xb9), 0);
	CHECK_EQ(fi_inject(P.a.ep, NULL, 0, P.a.peer), 0);
	expect(P.b.cq, (void *)0xb9, FI_RECV | FI_MSG, 0, 0);
	/* And back, B to A, with the send posted before the receive. */
	ct_fill(bbuf, 100, 9);
	CHECK_EQ(fi_send(P.b.ep, bbuf, 100, bdesc(), P.b.peer, (void *)0xb2), 0);
	CHECK_EQ(fi_recv(P.a.ep, abuf, 4096, adesc(), FI_ADDR_UNSPEC, (void *)0xa2), 0);
	expect(P.b.cq, (void *)0xb2, FI_SEND | FI_MSG, 0, 0);
	expect(P.a.cq, (void *)0xa2, FI_RECV | FI_MSG, 100, 0);
	CHECK(ct_same(abuf, 100, 9));
}

static void order_and_readfrom(void)
{
	/* Three messages land in three receives in posting order. */
	for (int i = 0; i < 3; i++)
		CHECK_EQ(fi_recv(P.b.ep, bbuf + i * 256, 256, bdesc(), FI_ADDR_UNSPEC,
				 (void *)(uintptr_t)(0x100 + i)),
			 0);
	for (int i = 0; i < 3; i++) {
		ct_fill(abuf + i * 256, 10 + i, 20 + i);
		CHECK_EQ(fi_send(P.a.ep, abuf + i * 256, 10 + i, adesc(), P.a.peer, NULL), 0);
	}
	/* The three send completions, several per fi_cq_read when the format allows it. */
	if (fmt == FI_CQ_FORMAT_TAGGED && !sread) {
		struct fi_cq_tagged_entry es[4];
		int got = 0;
		double end = ct_now() + 30;
		while (got < 3 && ct_now() < end) {
			ssize_t r = fi_cq_read(P.a.cq, es + got, 4 - got);
			if (r > 0)
				got += (int)r;
			else
				CHECK_EQ(r, -FI_EAGAIN);
		}
		CHECK_EQ(got, 3);
		for (int i = 0; i < got; i++)
			CHECK_EQ(es[i].flags, FI_SEND | FI_MSG);
	} else {
		for (int i = 0; i < 3; i++)
			expect(P.a.cq, NULL, FI_SEND | FI_MSG, 0, 0);
	}
	for (int i = 0; i < 3; i++) {
		struct fi_cq_tagged_entry e;
		fi_addr_t src = 12345;
		CHECK(wait_entry(P.b.cq, &e, &src));
		CHECK(e.op_context == (void *)(uintptr_t)(0x100 + i));
		if (fmt != FI_CQ_FORMAT_CONTEXT)
			CHECK_EQ(e.len, 10 + i);
		/* With FI_SOURCE the sender's AV address; without it, it may be
		 * FI_ADDR_NOTAVAIL (fi_cq(3)). */
		if (source)
			CHECK_EQ(src, P.b.peer);
		else
			CHECK(src == P.b.peer || src == FI_ADDR_NOTAVAIL);
		CHECK(ct_same(bbuf + i * 256, 10 + i, 20 + i));
	}
}

static void data_and_inject(void)
{
	size_t inject = P.list->tx_attr->inject_size;

	/* Immediate data: FI_REMOTE_CQ_DATA at the receiver (32 bits: cq_data_size 4). */
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 4096, bdesc(), FI_ADDR_UNSPEC, (void *)0xb3), 0);
	ct_fill(abuf, 300, 3);
	CHECK_EQ(fi_senddata(P.a.ep, abuf, 300, adesc(), 0xdeadbeef, P.a.peer, (void *)0xa3),
		 0);
	expect(P.a.cq, (void *)0xa3, FI_SEND | FI_MSG, 0, 0);
	expect(P.b.cq, (void *)0xb3, FI_RECV | FI_MSG | FI_REMOTE_CQ_DATA, 300, 0xdeadbeef);
	CHECK(ct_same(bbuf, 300, 3));

	/* Inject: the buffer is free at once, no completion at the sender. */
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 4096, bdesc(), FI_ADDR_UNSPEC, (void *)0xb4), 0);
	ct_fill(abuf, inject, 4);
	CHECK_EQ(fi_inject(P.a.ep, abuf, inject, P.a.peer), 0);
	memset(abuf, 0, inject);
	expect(P.b.cq, (void *)0xb4, FI_RECV | FI_MSG, inject, 0);
	CHECK(ct_same(bbuf, inject, 4));
	CHECK(ct_quiet(P.a.cq));

	/* Injectdata. */
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 4096, bdesc(), FI_ADDR_UNSPEC, (void *)0xb5), 0);
	ct_fill(abuf, 16, 5);
	CHECK_EQ(fi_injectdata(P.a.ep, abuf, 16, 0x1234, P.a.peer), 0);
	expect(P.b.cq, (void *)0xb5, FI_RECV | FI_MSG | FI_REMOTE_CQ_DATA, 16, 0x1234);
	CHECK(ct_same(bbuf, 16, 5));
	CHECK(ct_quiet(P.a.cq));

	/* Above inject_size: -FI_EMSGSIZE (fi_msg(3)). */
	CHECK_EQ(fi_inject(P.a.ep, abuf, inject + 1, P.a.peer), -FI_EMSGSIZE);
	CHECK_EQ(fi_injectdata(P.a.ep, abuf, inject + 1, 1, P.a.peer), -FI_EMSGSIZE);
}

static void vectors_and_msgs(void)
{
	void *ad[2] = { adesc(), adesc() }, *bd[2] = { bdesc(), bdesc() };
	struct iovec siov[2] = { { abuf, 100 }, { abuf + 8192, 5000 } };
	struct iovec riov[2] = { { bbuf, 3000 }, { bbuf + 8192, 3000 } };

	ct_fill(abuf, 100, 6);
	ct_fill(abuf + 8192, 5000, 7);
	CHECK_EQ(fi_recvv(P.b.ep, riov, bd, 2, FI_ADDR_UNSPEC, (void *)0xb6), 0);
	CHECK_EQ(fi_sendv(P.a.ep, siov, ad, 2, P.a.peer, (void *)0xa6), 0);
	expect(P.a.cq, (void *)0xa6, FI_SEND | FI_MSG, 0, 0);
	expect(P.b.cq, (void *)0xb6, FI_RECV | FI_MSG, 5100, 0);
	/* Scattered in order: 100 bytes of one pattern, then the other's 5000. */
	CHECK(ct_same(bbuf, 100, 6));
	char *expect_tail = ct_pages(8192);
	ct_fill(expect_tail, 5000, 7);
	CHECK(memcmp(bbuf + 100, expect_tail, 2900) == 0);
	CHECK(memcmp(bbuf + 8192, expect_tail + 2900, 2100) == 0);

	/* sendmsg with remote CQ data, recvmsg with FI_COMPLETION. */
	struct fi_msg sm = { .msg_iov = siov, .desc = ad, .iov_count = 1, .addr = P.a.peer,
			     .context = (void *)0xa7, .data = 77 };
	struct fi_msg rm = { .msg_iov = riov, .desc = bd, .iov_count = 1,
			     .addr = FI_ADDR_UNSPEC, .context = (void *)0xb7 };
	CHECK_EQ(fi_recvmsg(P.b.ep, &rm, FI_COMPLETION), 0);
	CHECK_EQ(fi_sendmsg(P.a.ep, &sm, FI_REMOTE_CQ_DATA | FI_COMPLETION), 0);
	expect(P.a.cq, (void *)0xa7, FI_SEND | FI_MSG, 0, 0);
	expect(P.b.cq, (void *)0xb7, FI_RECV | FI_MSG | FI_REMOTE_CQ_DATA, 100, 77);

	/* sendmsg with FI_INJECT: the buffer is free on return, and the completion is still
	 * written (fi_msg(3): only fi_inject suppresses it). */
	CHECK_EQ(fi_recvmsg(P.b.ep, &rm, 0), 0);
	sm.context = (void *)0xa8;
	ct_fill(abuf, 100, 8);
	CHECK_EQ(fi_sendmsg(P.a.ep, &sm, FI_INJECT), 0);
	memset(abuf, 0, 100);
	expect(P.b.cq, (void *)0xb7, FI_RECV | FI_MSG, 100, 0);
	CHECK(ct_same(bbuf, 100, 8));
	struct fi_cq_tagged_entry e;
	ssize_t r = ct_read(P.a.cq, &e, NULL, 2);
	CHECK(r == 1 && e.op_context == (void *)0xa8);
}

/* A message longer than its (untagged) receive. fi_cq(3) and fi_msg(3): the receive
 * completes in error FI_ETRUNC with olen the bytes cut off and its buffer holding the
 * first bytes; the send completes normally, and the connection carries the next message. */
static void untagged_truncation(void)
{
	struct fi_cq_err_entry err;
	struct fi_cq_tagged_entry e;
	ct_fill(abuf, 1000, 13);
	memset(bbuf, 0, 200);
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 100, bdesc(), FI_ADDR_UNSPEC, (void *)0xbf), 0);
	CHECK_EQ(fi_send(P.a.ep, abuf, 1000, adesc(), P.a.peer, (void *)0xaf), 0);
	ssize_t r = ct_read(P.b.cq, &e, NULL, 10);
	CHECK_EQ(r, -FI_EAVAIL);
	CHECK_EQ(fi_cq_readerr(P.b.cq, &err, 0), 1);
	CHECK_EQ(err.err, FI_ETRUNC);
	CHECK_EQ(err.olen, 900);
	CHECK_EQ(err.len, 100);
	CHECK(err.op_context == (void *)0xbf);
	CHECK(err.flags & FI_RECV);
	CHECK(ct_same(bbuf, 100, 13));
	CHECK(bbuf[100] == 0);
	r = ct_read(P.a.cq, &e, NULL, 10);
	CHECK_EQ(r, 1);
	CHECK(e.op_context == (void *)0xaf);
	/* The same connection takes the next message, whole. */
	ct_fill(abuf, 64, 14);
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 100, bdesc(), FI_ADDR_UNSPEC, (void *)0xc0), 0);
	CHECK_EQ(fi_send(P.a.ep, abuf, 64, adesc(), P.a.peer, (void *)0xb0), 0);
	expect(P.b.cq, (void *)0xc0, FI_RECV | FI_MSG, 64, 0);
	CHECK(ct_same(bbuf, 64, 14));
	r = ct_read(P.a.cq, &e, NULL, 10);
	CHECK(r == 1 && e.op_context == (void *)0xb0);
}

/* (Tagged-format CQs: several entries per read, each naming its buffer's slot.)
 * Many messages through bounded windows of sends and receives: a send or receive the
 * provider cannot take now is -FI_EAGAIN (fi_msg(3)) and is retried after reading the
 * CQs; every message arrives once, in order (FI_ORDER_SAS), with its bytes. */
static void many(void)
{
	enum { N = 6000, W = 1500, LEN = 64 };
	int posted = 0, received = 0, sent = 0, completed = 0, bad = 0, eagain = 0;
	struct fi_cq_tagged_entry es[16];
	double end = ct_now() + 60;
	while ((received < N || completed < N) && ct_now() < end) {
		while (posted < N && posted - received < W) {
			ssize_t r = fi_recv(P.b.ep, bbuf + (posted % W) * LEN, LEN, bdesc(),
					    FI_ADDR_UNSPEC, (void *)(uintptr_t)(posted % W));
			if (r == -FI_EAGAIN) {
				eagain++;
				break;
			}
			if (r) {
				CHECK_EQ(r, 0);
				return;
			}
			posted++;
		}
		while (sent < N && sent - completed < W) {
			char *b = abuf + (sent % W) * LEN;
			ct_fill(b, LEN, (unsigned)sent);
			memcpy(b, &sent, sizeof(sent));
			ssize_t r = fi_send(P.a.ep, b, LEN, adesc(), P.a.peer, NULL);
			if (r == -FI_EAGAIN) {
				eagain++;
				break;
			}
			if (r) {
				CHECK_EQ(r, 0);
				return;
			}
			sent++;
		}
		ssize_t r = fi_cq_read(P.a.cq, es, 16);
		if (r > 0)
			completed += (int)r;
		else if (r != -FI_EAGAIN) {
			CHECK_EQ(r, -FI_EAGAIN);
			return;
		}
		r = fi_cq_read(P.b.cq, es, 16);
		if (r < 0 && r != -FI_EAGAIN) {
			CHECK_EQ(r, -FI_EAGAIN);
			return;
		}
		for (ssize_t i = 0; i < r; i++) {
			uintptr_t slot = (uintptr_t)es[i].op_context;
			char *b = bbuf + slot * LEN;
			char want[LEN];
			ct_fill(want, LEN, (unsigned)received);
			memcpy(want, &received, sizeof(received));
			if (memcmp(b, want, LEN) != 0 || es[i].len != LEN)
				bad++;
			received++;
		}
	}
	fprintf(stderr, "msg.c: %d messages, %d sends completed, %d -FI_EAGAIN\n", received,
		completed, eagain);
	CHECK_EQ(received, N);
	CHECK_EQ(completed, N);
	CHECK_EQ(bad, 0);
}

/* An endpoint sending to itself: the offer has FI_LOCAL_COMM. */
static void loopback(void)
{
	fi_addr_t self = FI_ADDR_NOTAVAIL;
	struct fi_cq_tagged_entry e;
	CHECK_EQ(fi_av_insert(P.a.av, P.a.name, 1, &self, 0, NULL), 1);
	CHECK(P.list->caps & FI_LOCAL_COMM);
	ct_fill(abuf, 32, 14);
	CHECK_EQ(fi_recv(P.a.ep, abuf + 4096, 64, adesc(), FI_ADDR_UNSPEC, (void *)0x5e1f), 0);
	CHECK_EQ(fi_send(P.a.ep, abuf, 32, adesc(), self, (void *)0x5e2f), 0);
	int sent = 0, got = 0;
	double end = ct_now() + 5;
	while ((!sent || !got) && ct_now() < end) {
		ssize_t r = fi_cq_read(P.a.cq, &e, 1);
		if (r == 1 && e.op_context == (void *)0x5e2f)
			sent = 1;
		if (r == 1 && e.op_context == (void *)0x5e1f)
			got = 1;
		if (r == -FI_EAVAIL)
			break;
	}
	CHECK(sent && got && ct_same(abuf + 4096, 32, 14));
}

static void bad_input(void)
{
	/* An AV index out of range, FI_ADDR_UNSPEC as a destination, a removed address. */
	CHECK_EQ(fi_send(P.a.ep, abuf, 8, adesc(), 99, NULL), -FI_EINVAL);
	CHECK_EQ(fi_send(P.a.ep, abuf, 8, adesc(), FI_ADDR_UNSPEC, NULL), -FI_EINVAL);
	CHECK_EQ(fi_inject(P.a.ep, abuf, 8, 1000000), -FI_EINVAL);
	CHECK_EQ(fi_senddata(P.a.ep, abuf, 8, adesc(), 1, 99, NULL), -FI_EINVAL);
	/* A descriptor that is not a region of the provider's. */
	uint64_t junk[8] = { 0 };
	CHECK_EQ(fi_send(P.a.ep, abuf, 8, junk, P.a.peer, NULL), -FI_EINVAL);
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 8, junk, FI_ADDR_UNSPEC, NULL), -FI_EINVAL);
	/* A receive buffer that is not memory. */
	CHECK_EQ(fi_recv(P.b.ep, NULL, 64, NULL, FI_ADDR_UNSPEC, NULL), -FI_EINVAL);
	/* NULL messages and iovec arrays, too many iovecs. */
	CHECK_EQ(fi_sendmsg(P.a.ep, NULL, 0), -FI_EINVAL);
	CHECK_EQ(fi_recvmsg(P.b.ep, NULL, 0), -FI_EINVAL);
	CHECK_EQ(fi_sendv(P.a.ep, NULL, NULL, 1, P.a.peer, NULL), -FI_EINVAL);
	struct iovec many[65];
	for (int i = 0; i < 65; i++)
		many[i] = (struct iovec){ abuf, 1 };
	CHECK_EQ(fi_sendv(P.a.ep, many, NULL, 65, P.a.peer, NULL), -FI_EINVAL);
	/* Nothing was sent by any of these. */
	CHECK(ct_quiet(P.a.cq));
	CHECK(ct_quiet(P.b.cq));
}

static void selective(void)
{
	/* Bound with FI_SELECTIVE_COMPLETION: fi_send and fi_recv write nothing, the *msg
	 * calls with FI_COMPLETION do; the data moves either way. */
	struct fi_cq_tagged_entry e;
	struct iovec siov = { abuf, 50 }, riov = { bbuf, 4096 };
	void *ad = adesc(), *bd = bdesc();
	ct_fill(abuf, 50, 11);
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 4096, bdesc(), FI_ADDR_UNSPEC, (void *)0xb1), 0);
	CHECK_EQ(fi_send(P.a.ep, abuf, 50, adesc(), P.a.peer, (void *)0xa1), 0);
	CHECK(ct_quiet(P.a.cq));
	CHECK(ct_quiet(P.b.cq));
	CHECK(ct_same(bbuf, 50, 11));

	struct fi_msg sm = { .msg_iov = &siov, .desc = &ad, .iov_count = 1, .addr = P.a.peer,
			     .context = (void *)0xa2 };
	struct fi_msg rm = { .msg_iov = &riov, .desc = &bd, .iov_count = 1,
			     .addr = FI_ADDR_UNSPEC, .context = (void *)0xb2 };
	ct_fill(abuf, 50, 12);
	CHECK_EQ(fi_recvmsg(P.b.ep, &rm, FI_COMPLETION), 0);
	CHECK_EQ(fi_sendmsg(P.a.ep, &sm, FI_COMPLETION), 0);
	expect(P.a.cq, (void *)0xa2, FI_SEND | FI_MSG, 0, 0);
	expect(P.b.cq, (void *)0xb2, FI_RECV | FI_MSG, 50, 0);
	CHECK(ct_same(bbuf, 50, 12));

	/* One without, one with: only the second reports. */
	CHECK_EQ(fi_recvmsg(P.b.ep, &rm, 0), 0);
	CHECK_EQ(fi_recvmsg(P.b.ep, &rm, FI_COMPLETION), 0);
	sm.context = (void *)0xa3;
	CHECK_EQ(fi_sendmsg(P.a.ep, &sm, 0), 0);
	CHECK_EQ(fi_sendmsg(P.a.ep, &sm, FI_COMPLETION), 0);
	expect(P.a.cq, (void *)0xa3, FI_SEND | FI_MSG, 0, 0);
	expect(P.b.cq, (void *)0xb2, FI_RECV | FI_MSG, 50, 0);
	CHECK(ct_read(P.a.cq, &e, NULL, 0.2) == -FI_EAGAIN);
	CHECK(ct_read(P.b.cq, &e, NULL, 0.2) == -FI_EAGAIN);
}

/* Programs without an out-of-band address exchange (fabtests as runfabtests.sh runs them):
 * the server asks fi_getinfo for a service number with FI_SOURCE and its endpoint takes
 * that number; the client names this host (127.0.0.1) and the number, and reaches that
 * endpoint. A number no open endpoint holds reaches nothing. */
static void host_address(const struct ct_opts *o)
{
	struct fi_info *h = ct_hints(FI_MSG, local), *srv = NULL, *cli = NULL, *none = NULL;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, "47011", FI_SOURCE, h, &srv), 0);
	CHECK_EQ(fi_getinfo(CT_VERSION, "127.0.0.1", "47011", 0, h, &cli), 0);
	CHECK_EQ(fi_getinfo(CT_VERSION, "127.0.0.1", "47012", 0, h, &none), 0);
	fi_freeinfo(h);
	REQUIRE(srv && cli && cli->next && cli->dest_addr && none && none->dest_addr);
	struct ct_side s, c;
	ct_side_open(&P, &s, srv, o);	    /* on rb0 */
	ct_side_open(&P, &c, cli->next, o); /* on rb1 */
	/* The server's address carries the number it asked for. */
	struct fi_info *again = NULL;
	h = ct_hints(FI_MSG, local);
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, "47011", FI_SOURCE, h, &again), 0);
	fi_freeinfo(h);
	REQUIRE(again && again->src_addrlen == s.namelen);
	CHECK(memcmp(again->src_addr, s.name, s.namelen) == 0);
	fi_freeinfo(again);

	char *sb = ct_pages(4096), *cb = ct_pages(4096);
	struct fid_mr *smr = NULL, *cmr = NULL;
	if (local) {
		REQUIRE(fi_mr_reg(s.dom, sb, 4096, FI_SEND | FI_RECV, 0, 0, 0, &smr, NULL) == 0);
		REQUIRE(fi_mr_reg(c.dom, cb, 4096, FI_SEND | FI_RECV, 0, 0, 0, &cmr, NULL) == 0);
	}
	void *sd = smr ? fi_mr_desc(smr) : NULL, *cd = cmr ? fi_mr_desc(cmr) : NULL;
	fi_addr_t to_srv, to_cli, to_none;
	CHECK_EQ(fi_av_insert(c.av, cli->dest_addr, 1, &to_srv, 0, NULL), 1);
	CHECK_EQ(fi_av_insert(c.av, none->dest_addr, 1, &to_none, 0, NULL), 1);
	CHECK_EQ(fi_av_insert(s.av, c.name, 1, &to_cli, 0, NULL), 1);
	strcpy(cb, "by host and service");
	MUST(fi_recv(s.ep, sb, 64, sd, FI_ADDR_UNSPEC, sb));
	MUST(fi_send(c.ep, cb, 20, cd, to_srv, cb));
	expect(s.cq, sb, FI_RECV | FI_MSG, 20, 0);
	CHECK(strcmp(sb, "by host and service") == 0);
	expect(c.cq, cb, FI_SEND | FI_MSG, 0, 0);
	/* And back, to the client's own address. */
	strcpy(sb + 64, "reply");
	MUST(fi_recv(c.ep, cb + 64, 64, cd, FI_ADDR_UNSPEC, cb + 64));
	MUST(fi_send(s.ep, sb + 64, 6, sd, to_cli, sb + 64));
	expect(c.cq, cb + 64, FI_RECV | FI_MSG, 6, 0);
	CHECK(strcmp(cb + 64, "reply") == 0);
	expect(s.cq, sb + 64, FI_SEND | FI_MSG, 0, 0);
	/* 47012: no endpoint holds it. */
	struct fi_cq_err_entry err = {0};
	ssize_t r = fi_send(c.ep, cb, 4, cd, to_none, cb);
	if (r == 0)
		CHECK(ct_wait_err(c.cq, &err));
	CHECK(r == -FI_EHOSTUNREACH || err.err == FI_EHOSTUNREACH);

	if (local) {
		CHECK_EQ(fi_close(&smr->fid), 0);
		CHECK_EQ(fi_close(&cmr->fid), 0);
	}
	ct_side_close(&c);
	ct_side_close(&s);
	fi_freeinfo(srv);
	fi_freeinfo(cli);
	fi_freeinfo(none);
}

int main(int argc, char **argv)
{
	static char name[64];
	if (argc < 3) {
		fprintf(stderr, "usage: msg local|nolocal context|msg|data|tagged [selective]\n");
		return 2;
	}
	local = strcmp(argv[1], "local") == 0;
	fmt = strcmp(argv[2], "context") == 0 ? FI_CQ_FORMAT_CONTEXT
	      : strcmp(argv[2], "msg") == 0   ? FI_CQ_FORMAT_MSG
	      : strcmp(argv[2], "data") == 0  ? FI_CQ_FORMAT_DATA
					      : FI_CQ_FORMAT_TAGGED;
	const char *opt = argc > 3 ? argv[3] : "";
	int sel = strcmp(opt, "selective") == 0, map = strcmp(opt, "map") == 0;
	sread = strcmp(opt, "sread") == 0;
	source = strcmp(opt, "source") == 0;
	snprintf(name, sizeof(name), "msg %s %s%s%s", argv[1], argv[2], *opt ? " " : "", opt);
	ct_name = name;

	struct ct_opts o = { .caps = FI_MSG | (source ? FI_SOURCE : 0), .mr_local = local,
			     .format = fmt,
			     .bind_flags = sel ? FI_SELECTIVE_COMPLETION : 0,
			     .av_type = map ? FI_AV_MAP : FI_AV_TABLE,
			     .wait_obj = sread ? FI_WAIT_UNSPEC : FI_WAIT_NONE };
	ct_pair_open(&P, &o);
	/* FI_SOURCE is given to those who ask, and only to them. */
	CHECK_EQ(!!(P.list->caps & FI_SOURCE), source);
	if (local)
		CHECK(P.list->domain_attr->mr_mode & FI_MR_LOCAL);
	else
		CHECK_EQ(P.list->domain_attr->mr_mode & FI_MR_LOCAL, 0);
	ct_pair_bufs(&P, local, BUFLEN, &abuf, &bbuf, &amr, &bmr);
	if (sel) {
		selective();
	} else {
		sizes();
		order_and_readfrom();
		data_and_inject();
		vectors_and_msgs();
		bad_input();
		if (fmt == FI_CQ_FORMAT_TAGGED && !sread)
			many();
		untagged_truncation();
		loopback();
		host_address(&o);
	}
	ct_pair_bufs_close(local, amr, bmr);
	ct_pair_close(&P);
	return ct_summary_exit();
}
