/* msgtag.c: tagged messages on connected endpoints (FI_EP_MSG with FI_TAGGED).
 *
 * The offer (FI_TAGGED for connected endpoints that ask, trimmed away for those that do
 * not), a connection from rb1 to a passive endpoint of rb0 whose private data arrives as
 * sent both ways, then tagged messages both ways: unexpected ones (sent before their
 * receive), receives posted out of tag order, an ignore mask, a 1 MiB rendezvous, remote
 * CQ data, an inject, and a message longer than its receive (FI_ETRUNC); untagged messages
 * still go over the connection; a tagged send before the connection is -FI_ENOTCONN.
 */
#include "ctest.h"

struct cm_entry {
	struct fi_eq_cm_entry e;
	char data[64];
};

/* Receives a tagged completion on `cq` and checks it. */
static void expect(struct fid_cq *cq, void *ctx, uint64_t tag, size_t len, const char *buf,
		   unsigned seed)
{
	struct fi_cq_tagged_entry e;
	if (!ct_wait(cq, &e)) {
		CHECK(!"a tagged receive");
		return;
	}
	CHECK(e.op_context == ctx);
	CHECK_EQ(e.flags & (FI_RECV | FI_TAGGED), FI_RECV | FI_TAGGED);
	CHECK_EQ(e.tag, tag);
	CHECK_EQ(e.len, len);
	CHECK(ct_same(buf, len, seed));
}

int main(void)
{
	ct_name = "msgtag";
	struct fi_info *h = ct_hints(FI_MSG | FI_TAGGED, 0), *list = NULL, *plain = NULL;
	h->ep_attr->type = FI_EP_MSG;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	REQUIRE(list && list->next);
	CHECK_EQ(list->ep_attr->type, FI_EP_MSG);
	CHECK(list->caps & FI_TAGGED);
	h->caps = FI_MSG;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &plain) == 0);
	CHECK_EQ(plain->caps & FI_TAGGED, 0);
	fi_freeinfo(plain);
	fi_freeinfo(h);

	struct fid_fabric *fab;
	struct fid_domain *da, *db;
	REQUIRE(fi_fabric(list->fabric_attr, &fab, NULL) == 0);
	REQUIRE(fi_domain(fab, list, &da, NULL) == 0);
	REQUIRE(fi_domain(fab, list->next, &db, NULL) == 0);
	struct fi_eq_attr eq_attr = {.size = 16, .wait_obj = FI_WAIT_UNSPEC};
	struct fid_eq *eqa, *eqb;
	REQUIRE(fi_eq_open(fab, &eq_attr, &eqa, NULL) == 0);
	REQUIRE(fi_eq_open(fab, &eq_attr, &eqb, NULL) == 0);
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fid_cq *cqa, *cqb;
	REQUIRE(fi_cq_open(da, &cq_attr, &cqa, NULL) == 0);
	REQUIRE(fi_cq_open(db, &cq_attr, &cqb, NULL) == 0);

	struct fid_pep *pep;
	REQUIRE(fi_passive_ep(fab, list, &pep, NULL) == 0);
	REQUIRE(fi_pep_bind(pep, &eqa->fid, 0) == 0);
	REQUIRE(fi_listen(pep) == 0);
	char pepname[64];
	size_t plen = sizeof(pepname);
	REQUIRE(fi_getname(&pep->fid, pepname, &plen) == 0);

	char *abuf = ct_pages(4 << 20), *bbuf = ct_pages(4 << 20);
	struct fid_ep *b = ct_ep_open(db, list->next, &eqb->fid, cqb);
	CHECK_EQ(fi_tsend(b, bbuf, 8, NULL, 0, 1, NULL), -FI_ENOTCONN);

	/* The connection, private data intact both ways (56 bytes: the most there is). */
	char req[56], rep[56];
	ct_fill(req, sizeof(req), 5);
	ct_fill(rep, sizeof(rep), 6);
	CHECK_EQ(fi_connect(b, pepname, req, sizeof(req)), 0);
	struct cm_entry c;
	uint32_t ev = 0;
	REQUIRE(fi_eq_sread(eqa, &ev, &c, sizeof(c), 10000, 0) ==
		(ssize_t)(sizeof(c.e) + sizeof(req)));
	CHECK_EQ(ev, FI_CONNREQ);
	CHECK(ct_same(c.data, sizeof(req), 5));
	struct fid_ep *a = ct_ep_open(da, c.e.info, &eqa->fid, cqa);
	fi_freeinfo(c.e.info);
	CHECK_EQ(fi_accept(a, rep, sizeof(rep)), 0);
	CHECK_EQ(fi_eq_sread(eqb, &ev, &c, sizeof(c), 10000, 0),
		 (ssize_t)(sizeof(c.e) + sizeof(rep)));
	CHECK_EQ(ev, FI_CONNECTED);
	CHECK(ct_same(c.data, sizeof(rep), 6));
	CHECK(fi_eq_sread(eqa, &ev, &c, sizeof(c), 10000, 0) >= (ssize_t)sizeof(c.e));
	CHECK_EQ(ev, FI_CONNECTED);

	struct fi_cq_tagged_entry e;
	/* Unexpected: B sends three tagged messages (eager: a rendezvous completes once
	 * received) before A posts a receive, then A posts them in another order (tags 3, 1,
	 * then 2 through a mask). */
	for (int t = 1; t <= 3; t++) {
		ct_fill(bbuf + 4096 * t, 50 * t, t);
		CHECK_EQ(fi_tsend(b, bbuf + 4096 * t, 50 * t, NULL, 0, 0x500 + t,
				  (void *)(uintptr_t)(0xb0 + t)),
			 0);
	}
	for (int t = 1; t <= 3; t++)
		CHECK(ct_wait(cqb, &e) && e.op_context == (void *)(uintptr_t)(0xb0 + t) &&
		      e.flags == (FI_SEND | FI_TAGGED));
	CHECK_EQ(fi_trecv(a, abuf + 4096 * 3, 4096, NULL, 0, 0x503, 0, (void *)0xa3), 0);
	expect(cqa, (void *)0xa3, 0x503, 150, abuf + 4096 * 3, 3);
	CHECK_EQ(fi_trecv(a, abuf + 4096 * 1, 4096, NULL, 0, 0x501, 0, (void *)0xa1), 0);
	expect(cqa, (void *)0xa1, 0x501, 50, abuf + 4096 * 1, 1);
	CHECK_EQ(fi_trecv(a, abuf + 4096 * 2, 4096, NULL, 0, 0x5f0, 0xff, (void *)0xa2), 0);
	expect(cqa, (void *)0xa2, 0x502, 100, abuf + 4096 * 2, 2);

	/* A to B: receives posted first, out of order; a rendezvous of 1 MiB with CQ data; an
	 * inject. */
	char *big = abuf + (1 << 20), *bigin = bbuf + (2 << 20);
	ct_fill(big, 1 << 20, 9);
	CHECK_EQ(fi_trecv(b, bigin, 1 << 20, NULL, 0, 0x62, 0, (void *)0xb2), 0);
	CHECK_EQ(fi_trecv(b, bbuf + 20000, 64, NULL, 0, 0x61, 0, (void *)0xb1), 0);
	ct_fill(abuf + 20000, 40, 7);
	CHECK_EQ(fi_tinject(a, abuf + 20000, 40, 0, 0x61), 0);
	CHECK_EQ(fi_tsenddata(a, big, 1 << 20, NULL, 0xd00d, 0, 0x62, (void *)0xa4), 0);
	CHECK(ct_wait(cqa, &e) && e.op_context == (void *)0xa4);
	int got1 = 0, got2 = 0;
	for (int k = 0; k < 2; k++) {
		if (!ct_wait(cqb, &e)) {
			CHECK(!"a tagged receive of B");
			break;
		}
		if (e.op_context == (void *)0xb1) {
			got1++;
			CHECK(e.tag == 0x61 && e.len == 40 && ct_same(bbuf + 20000, 40, 7));
		} else if (e.op_context == (void *)0xb2) {
			got2++;
			CHECK(e.tag == 0x62 && e.len == 1 << 20 && ct_same(bigin, 1 << 20, 9));
			CHECK(e.flags & FI_REMOTE_CQ_DATA);
			CHECK_EQ(e.data, 0xd00d);
		}
	}
	CHECK(got1 == 1 && got2 == 1);

	/* Longer than its receive: FI_ETRUNC. */
	CHECK_EQ(fi_trecv(a, abuf + 30000, 16, NULL, 0, 0x70, 0, (void *)0xa7), 0);
	CHECK_EQ(fi_tsend(b, bbuf, 100, NULL, 0, 0x70, (void *)0xb7), 0);
	CHECK(ct_wait(cqb, &e) && e.op_context == (void *)0xb7);
	struct fi_cq_err_entry err;
	if (ct_wait_err(cqa, &err)) {
		CHECK_EQ(err.err, FI_ETRUNC);
		CHECK(err.op_context == (void *)0xa7);
		CHECK_EQ(err.olen, 100 - 16);
	} else {
		CHECK(!"a truncated receive");
	}

	/* Untagged messages still go over the connection. */
	CHECK_EQ(fi_recv(a, abuf + 40000, 64, NULL, 0, (void *)0xa8), 0);
	ct_fill(bbuf + 40000, 50, 8);
	CHECK_EQ(fi_send(b, bbuf + 40000, 50, NULL, 0, (void *)0xb8), 0);
	CHECK(ct_wait(cqb, &e) && e.op_context == (void *)0xb8);
	CHECK(ct_wait(cqa, &e) && e.op_context == (void *)0xa8 && e.len == 50 &&
	      ct_same(abuf + 40000, 50, 8));
	CHECK(ct_quiet(cqa) && ct_quiet(cqb));

	CHECK_EQ(fi_close(&a->fid), 0);
	CHECK_EQ(fi_close(&b->fid), 0);
	CHECK_EQ(fi_close(&pep->fid), 0);
	CHECK_EQ(fi_close(&cqa->fid), 0);
	CHECK_EQ(fi_close(&cqb->fid), 0);
	CHECK_EQ(fi_close(&eqa->fid), 0);
	CHECK_EQ(fi_close(&eqb->fid), 0);
	CHECK_EQ(fi_close(&da->fid), 0);
	CHECK_EQ(fi_close(&db->fid), 0);
	CHECK_EQ(fi_close(&fab->fid), 0);
	fi_freeinfo(list);
	return ct_summary_exit();
}
