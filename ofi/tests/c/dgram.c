/* dgram.c: datagram endpoints (FI_EP_DGRAM, fi_endpoint(3)) between two endpoints of one
 * process: what fi_getinfo offers and refuses, datagrams of every size up to one packet
 * with their data checked, gathered sends and scattered receives, remote CQ data, inject,
 * what a datagram endpoint refuses (larger than a packet, tagged messages, RMA,
 * multi-receive buffers), datagrams dropped where nothing can take them (no receive
 * posted, a receive too small) with the endpoints going on, and an endpoint reached
 * through this host's address and a service number (FI_SOURCE).
 *
 * Usage: dgram local|nolocal
 */
#include "ctest.h"

static struct ct_pair P;
static int local;
static char *abuf, *bbuf;
static struct fid_mr *amr, *bmr;
#define BUFLEN ((size_t)1 << 16)
#define MAX_MSG 4096

static struct fi_info *dgram_hints(void)
{
	struct fi_info *h = ct_hints(FI_MSG, local);
	h->ep_attr->type = FI_EP_DGRAM;
	return h;
}

static void *adesc(void)
{
	return local ? fi_mr_desc(amr) : NULL;
}

static void *bdesc(void)
{
	return local ? fi_mr_desc(bmr) : NULL;
}

/* What fi_getinfo offers for datagram endpoints, and what it refuses. */
static void getinfo(void)
{
	struct fi_info *h = dgram_hints(), *list = NULL;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), 0);
	int n = 0;
	for (struct fi_info *i = list; i; i = i->next, n++) {
		CHECK_EQ(i->ep_attr->type, FI_EP_DGRAM);
		CHECK_EQ(i->ep_attr->max_msg_size, MAX_MSG);
		CHECK(i->caps & FI_MSG);
		CHECK_EQ(i->caps & (FI_TAGGED | FI_RMA | FI_ATOMIC | FI_MULTI_RECV), 0);
		/* No prefix: receives hold the payload from their first byte. */
		CHECK_EQ(i->mode & FI_MSG_PREFIX, 0);
		CHECK_EQ(i->tx_attr->mode & FI_MSG_PREFIX, 0);
		/* Datagrams promise no order. */
		CHECK_EQ(i->tx_attr->msg_order, 0);
		CHECK(i->tx_attr->inject_size > 0);
	}
	CHECK_EQ(n, 2);
	fi_freeinfo(list);

	/* Tagged messages, RMA, more than one packet, an ordering: nothing. */
	h->caps = FI_MSG | FI_TAGGED;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->caps = FI_MSG | FI_RMA;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->caps = FI_MSG;
	h->ep_attr->max_msg_size = MAX_MSG + 1;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->ep_attr->max_msg_size = 0;
	h->tx_attr->msg_order = FI_ORDER_SAS;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->tx_attr->msg_order = 0;
	/* An application that handles a prefix still gets none. */
	h->mode = FI_MSG_PREFIX | FI_CONTEXT;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), 0);
	if (list)
		CHECK_EQ(list->mode & FI_MSG_PREFIX, 0);
	fi_freeinfo(list);
	/* Without an endpoint type, each NIC's RDM offer comes first, its datagram one after. */
	h->ep_attr->type = FI_EP_UNSPEC;
	h->mode = 0;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), 0);
	if (list && list->next) {
		CHECK_EQ(list->ep_attr->type, FI_EP_RDM);
		CHECK_EQ(list->next->ep_attr->type, FI_EP_DGRAM);
		CHECK(strcmp(list->domain_attr->name, list->next->domain_attr->name) == 0);
	}
	fi_freeinfo(list);
	fi_freeinfo(h);
}

static void open_pair(void)
{
	struct fi_info *h = dgram_hints();
	static const struct ct_opts o = {.caps = FI_MSG};
	memset(&P, 0, sizeof(P));
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &P.list) == 0);
	fi_freeinfo(h);
	REQUIRE(P.list && P.list->next);
	REQUIRE(fi_fabric(P.list->fabric_attr, &P.fab, NULL) == 0);
	/* The name is there before the endpoint is enabled (ct_side_open asks after). */
	ct_side_open(&P, &P.a, P.list, &o);
	ct_side_open(&P, &P.b, P.list->next, &o);
	REQUIRE(fi_av_insert(P.a.av, P.b.name, 1, &P.a.peer, 0, NULL) == 1);
	REQUIRE(fi_av_insert(P.b.av, P.a.name, 1, &P.b.peer, 0, NULL) == 1);
	ct_pair_bufs(&P, local, BUFLEN, &abuf, &bbuf, &amr, &bmr);
}

/* B's next receive completion: context, flags, length, buffer, bytes of pattern `seed`,
 * and its source, A (fi_cq_readfrom). */
static void expect_recv(void *ctx, uint64_t flags, size_t len, char *buf, unsigned seed)
{
	struct fi_cq_tagged_entry e;
	fi_addr_t src = 777;
	if (ct_read(P.b.cq, &e, &src, 30) != 1) {
		CHECK(!"a receive completion");
		return;
	}
	CHECK_EQ(src, P.b.peer);
	CHECK(e.op_context == ctx);
	CHECK_EQ(e.flags, flags);
	CHECK_EQ(e.len, len);
	CHECK(e.buf == buf);
	CHECK(ct_same(buf, len, seed));
}

/* A's next completion is its send `ctx`. */
static void expect_sent(void *ctx)
{
	struct fi_cq_tagged_entry e;
	CHECK(ct_wait(P.a.cq, &e) && e.op_context == ctx && e.flags == (FI_SEND | FI_MSG));
}

static void sizes(void)
{
	static const size_t lens[] = {1, 8, 63, 64, 204, 205, 236, 237, 1000, 4095, MAX_MSG};
	for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
		size_t len = lens[k];
		unsigned seed = 10 + (unsigned)k;
		memset(bbuf, 0, MAX_MSG + 64);
		CHECK_EQ(fi_recv(P.b.ep, bbuf, MAX_MSG, bdesc(), FI_ADDR_UNSPEC, (void *)0xb0), 0);
		ct_fill(abuf, len, seed);
		CHECK_EQ(fi_send(P.a.ep, abuf, len, adesc(), P.a.peer, (void *)0xa0), 0);
		expect_sent((void *)0xa0);
		expect_recv((void *)0xb0, FI_RECV | FI_MSG, len, bbuf, seed);
		/* Nothing written past the datagram. */
		CHECK_EQ(bbuf[len], 0);
	}
	/* A zero-length datagram. */
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 64, bdesc(), FI_ADDR_UNSPEC, (void *)0xb1), 0);
	CHECK_EQ(fi_send(P.a.ep, abuf, 0, adesc(), P.a.peer, (void *)0xa1), 0);
	expect_sent((void *)0xa1);
	expect_recv((void *)0xb1, FI_RECV | FI_MSG, 0, bbuf, 0);
}

static void vectors_data_inject(void)
{
	/* Gathered from three buffers, scattered over two. */
	struct iovec out[3] = {{abuf, 100}, {abuf + 1000, 900}, {abuf + 3000, 2000}};
	void *od[3] = {adesc(), adesc(), adesc()};
	struct iovec in[2] = {{bbuf, 1500}, {bbuf + 8192, 2596}};
	void *id[2] = {bdesc(), bdesc()};
	ct_fill(abuf, 100, 1);
	ct_fill(abuf + 1000, 900, 2);
	ct_fill(abuf + 3000, 2000, 3);
	CHECK_EQ(fi_recvv(P.b.ep, in, id, 2, FI_ADDR_UNSPEC, (void *)0xb2), 0);
	CHECK_EQ(fi_sendv(P.a.ep, out, od, 3, P.a.peer, (void *)0xa2), 0);
	expect_sent((void *)0xa2);
	struct fi_cq_tagged_entry e;
	if (ct_wait(P.b.cq, &e)) {
		CHECK(e.op_context == (void *)0xb2);
		CHECK_EQ(e.len, 3000);
		CHECK(ct_same(bbuf, 100, 1) && ct_same(bbuf + 100, 900, 2));
		CHECK(memcmp(bbuf + 1000, abuf + 3000, 500) == 0);
		CHECK(memcmp(bbuf + 8192, abuf + 3500, 1500) == 0);
	}

	/* Remote CQ data. */
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 64, bdesc(), FI_ADDR_UNSPEC, (void *)0xb3), 0);
	ct_fill(abuf, 32, 4);
	CHECK_EQ(fi_senddata(P.a.ep, abuf, 32, adesc(), 0xfeed, P.a.peer, (void *)0xa3), 0);
	expect_sent((void *)0xa3);
	if (ct_wait(P.b.cq, &e)) {
		CHECK(e.op_context == (void *)0xb3);
		CHECK_EQ(e.flags, FI_RECV | FI_MSG | FI_REMOTE_CQ_DATA);
		CHECK_EQ(e.data, 0xfeed);
		CHECK_EQ(e.len, 32);
		CHECK(ct_same(bbuf, 32, 4));
	}

	/* Inject: no completion for the sender, the buffer free at once; up to inject_size. */
	size_t inject = P.a.info->tx_attr->inject_size;
	CHECK_EQ(fi_recv(P.b.ep, bbuf, MAX_MSG, bdesc(), FI_ADDR_UNSPEC, (void *)0xb4), 0);
	ct_fill(abuf, inject, 5);
	CHECK_EQ(fi_inject(P.a.ep, abuf, inject, P.a.peer), 0);
	memset(abuf, 0, inject);
	expect_recv((void *)0xb4, FI_RECV | FI_MSG, inject, bbuf, 5);
	CHECK(ct_quiet(P.a.cq));
	CHECK_EQ(fi_inject(P.a.ep, abuf, inject + 1, P.a.peer), -FI_EMSGSIZE);
}

static void refused(void)
{
	/* More than one packet. */
	CHECK_EQ(fi_send(P.a.ep, abuf, MAX_MSG + 1, adesc(), P.a.peer, NULL), -FI_EMSGSIZE);
	/* Tagged messages and RMA are not datagram operations. */
	CHECK_EQ(fi_tsend(P.a.ep, abuf, 8, adesc(), P.a.peer, 1, NULL), -FI_ENOSYS);
	CHECK_EQ(fi_trecv(P.b.ep, bbuf, 8, bdesc(), FI_ADDR_UNSPEC, 1, 0, NULL), -FI_ENOSYS);
	CHECK_EQ(fi_write(P.a.ep, abuf, 8, adesc(), P.a.peer, 0x1000, 1, NULL), -FI_ENOSYS);
	CHECK_EQ(fi_read(P.a.ep, abuf, 8, adesc(), P.a.peer, 0x1000, 1, NULL), -FI_ENOSYS);
	/* Nor are multi-receive buffers. */
	struct iovec iov = {bbuf, 4096};
	void *d = bdesc();
	struct fi_msg m = {.msg_iov = &iov, .desc = &d, .iov_count = 1, .addr = FI_ADDR_UNSPEC};
	CHECK_EQ(fi_recvmsg(P.b.ep, &m, FI_MULTI_RECV), -FI_EINVAL);
	/* An AV index that holds nothing. */
	CHECK_EQ(fi_send(P.a.ep, abuf, 8, adesc(), 99, NULL), -FI_EINVAL);
	CHECK(ct_quiet(P.a.cq) && ct_quiet(P.b.cq));
}

static void dropped(void)
{
	/* No receive posted: the sender completes, the datagram is gone. */
	ct_fill(abuf, 50, 6);
	CHECK_EQ(fi_send(P.a.ep, abuf, 50, adesc(), P.a.peer, (void *)0xa5), 0);
	expect_sent((void *)0xa5);
	CHECK(ct_quiet(P.b.cq));
	/* A receive too small: dropped, the receive stays posted and takes the next one. */
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 100, bdesc(), FI_ADDR_UNSPEC, (void *)0xb6), 0);
	ct_fill(abuf, 200, 7);
	CHECK_EQ(fi_send(P.a.ep, abuf, 200, adesc(), P.a.peer, (void *)0xa6), 0);
	expect_sent((void *)0xa6);
	CHECK(ct_quiet(P.b.cq));
	ct_fill(abuf, 100, 8);
	CHECK_EQ(fi_send(P.a.ep, abuf, 100, adesc(), P.a.peer, (void *)0xa7), 0);
	expect_sent((void *)0xa7);
	expect_recv((void *)0xb6, FI_RECV | FI_MSG, 100, bbuf, 8);
	/* And B answers A. */
	CHECK_EQ(fi_recv(P.a.ep, abuf, 64, adesc(), FI_ADDR_UNSPEC, (void *)0xa8), 0);
	ct_fill(bbuf, 16, 9);
	CHECK_EQ(fi_send(P.b.ep, bbuf, 16, bdesc(), P.b.peer, (void *)0xb8), 0);
	struct fi_cq_tagged_entry e;
	CHECK(ct_wait(P.b.cq, &e) && e.op_context == (void *)0xb8);
	CHECK(ct_wait(P.a.cq, &e) && e.op_context == (void *)0xa8 && e.len == 16);
	CHECK(ct_same(abuf, 16, 9));
}

/* An endpoint on a service number of the application's (FI_SOURCE), reached through this
 * host's address and that number; a number nobody holds is unreachable. */
static void named(void)
{
	static const struct ct_opts o = {.caps = FI_MSG};
	struct fi_info *h = dgram_hints(), *src = NULL, *dst = NULL, *none = NULL;
	char service[16];
	snprintf(service, sizeof(service), "%u", 20000 + (unsigned)getpid() % 20000);
	REQUIRE(fi_getinfo(CT_VERSION, NULL, service, FI_SOURCE, h, &src) == 0);
	struct ct_side c = {0};
	ct_side_open(&P, &c, src, &o);
	REQUIRE(fi_getinfo(CT_VERSION, "127.0.0.1", service, 0, h, &dst) == 0);
	REQUIRE(dst->dest_addr != NULL);
	fi_addr_t to;
	CHECK_EQ(fi_av_insert(P.b.av, dst->dest_addr, 1, &to, 0, NULL), 1);
	char *cbuf = ct_pages(4096);
	CHECK_EQ(fi_recv(c.ep, cbuf, 4096, NULL, FI_ADDR_UNSPEC, (void *)0xc0), 0);
	ct_fill(bbuf, 77, 11);
	CHECK_EQ(fi_send(P.b.ep, bbuf, 77, bdesc(), to, (void *)0xb9), 0);
	struct fi_cq_tagged_entry e;
	CHECK(ct_wait(P.b.cq, &e) && e.op_context == (void *)0xb9);
	fi_addr_t from = 777;
	CHECK(ct_read(c.cq, &e, &from, 30) == 1 && e.op_context == (void *)0xc0 && e.len == 77);
	CHECK(ct_same(cbuf, 77, 11));
	/* B is not in C's AV. */
	CHECK_EQ(from, FI_ADDR_NOTAVAIL);
	/* B's address inserted: C can tell, and answer it. */
	fi_addr_t b_at_c;
	CHECK_EQ(fi_av_insert(c.av, P.b.name, 1, &b_at_c, 0, NULL), 1);
	CHECK_EQ(fi_recv(c.ep, cbuf, 4096, NULL, FI_ADDR_UNSPEC, (void *)0xc1), 0);
	CHECK_EQ(fi_send(P.b.ep, bbuf, 5, bdesc(), to, (void *)0xba), 0);
	CHECK(ct_wait(P.b.cq, &e) && e.op_context == (void *)0xba);
	from = 777;
	CHECK(ct_read(c.cq, &e, &from, 30) == 1 && e.op_context == (void *)0xc1);
	CHECK_EQ(from, b_at_c);
	CHECK_EQ(fi_recv(P.b.ep, bbuf + 4096, 64, bdesc(), FI_ADDR_UNSPEC, (void *)0xbb), 0);
	CHECK_EQ(fi_send(c.ep, cbuf, 3, NULL, b_at_c, (void *)0xc2), 0);
	CHECK(ct_wait(c.cq, &e) && e.op_context == (void *)0xc2);
	from = 777;
	CHECK(ct_read(P.b.cq, &e, &from, 30) == 1 && e.op_context == (void *)0xbb && e.len == 3);
	/* C is in B's AV by its host address and number. */
	CHECK_EQ(from, to);
	/* Another number: nobody there. */
	snprintf(service, sizeof(service), "%u", 40000 + (unsigned)getpid() % 20000);
	REQUIRE(fi_getinfo(CT_VERSION, "127.0.0.1", service, 0, h, &none) == 0);
	fi_addr_t nobody;
	CHECK_EQ(fi_av_insert(P.b.av, none->dest_addr, 1, &nobody, 0, NULL), 1);
	CHECK_EQ(fi_send(P.b.ep, bbuf, 8, bdesc(), nobody, NULL), -FI_EHOSTUNREACH);
	ct_side_close(&c);
	fi_freeinfo(src);
	fi_freeinfo(dst);
	fi_freeinfo(none);
	fi_freeinfo(h);
}

int main(int argc, char **argv)
{
	ct_name = "dgram";
	local = argc > 1 && strcmp(argv[1], "local") == 0;
	getinfo();
	open_pair();
	sizes();
	vectors_data_inject();
	refused();
	dropped();
	named();
	ct_pair_bufs_close(local, amr, bmr);
	ct_pair_close(&P);
	return ct_summary_exit();
}
