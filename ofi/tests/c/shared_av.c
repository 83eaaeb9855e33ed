/* shared_av.c: named address vectors (fi_av(3) `name`, `map_addr`, FI_READ; the
 * FI_SHARED_AV capability).
 *
 * The offer for hints asking FI_SHARED_AV (as a capability or a domain capability: RDM and
 * datagram endpoints, not connected ones); an AV created by name on rb0, into which the
 * address of an endpoint of rb1 is inserted; the same AV opened again by name, read-only,
 * whose map (map_addr) gives the fi_addr_t the first opener got and whose endpoint sends
 * with it; what a read-only AV refuses (inserts, removals), a read-only open without a name
 * or of a name nobody created, a name that is not a plain file name; and the name going
 * with its creator's AV while the other opener keeps using its mapping.
 */
#include "ctest.h"

/* `a` sends `len` bytes of pattern `seed` to `to`; `b` receives them into `in`. */
static void exchange(struct fid_ep *a, struct fid_cq *cqa, fi_addr_t to, struct fid_ep *b,
		     struct fid_cq *cqb, char *out, char *in, size_t len, unsigned seed)
{
	struct fi_cq_tagged_entry e;
	CHECK_EQ(fi_recv(b, in, 4096, NULL, FI_ADDR_UNSPEC, (void *)0xb0), 0);
	ct_fill(out, len, seed);
	CHECK_EQ(fi_send(a, out, len, NULL, to, (void *)0xa0), 0);
	CHECK(ct_wait(cqa, &e) && e.op_context == (void *)0xa0);
	CHECK(ct_wait(cqb, &e) && e.op_context == (void *)0xb0 && e.len == len &&
	      ct_same(in, len, seed));
}

int main(void)
{
	ct_name = "shared_av";
	struct fi_info *h = ct_hints(FI_MSG | FI_SHARED_AV, 0), *list = NULL, *none = NULL;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	REQUIRE(list && list->next);
	CHECK(list->caps & FI_SHARED_AV);
	CHECK(list->domain_attr->caps & FI_SHARED_AV);
	/* As a domain capability; on datagram endpoints; not on connected ones. */
	struct fi_info *d = NULL;
	h->caps = FI_MSG;
	h->domain_attr->caps = FI_SHARED_AV;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &d) == 0);
	CHECK(d->domain_attr->caps & FI_SHARED_AV);
	fi_freeinfo(d);
	h->ep_attr->type = FI_EP_DGRAM;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &d) == 0);
	fi_freeinfo(d);
	h->ep_attr->type = FI_EP_MSG;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &none), -FI_ENODATA);
	fi_freeinfo(h);

	struct fid_fabric *fab;
	struct fid_domain *da, *db;
	REQUIRE(fi_fabric(list->fabric_attr, &fab, NULL) == 0);
	REQUIRE(fi_domain(fab, list, &da, NULL) == 0);
	REQUIRE(fi_domain(fab, list->next, &db, NULL) == 0);
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fid_cq *cqa, *cqa2, *cqb;
	REQUIRE(fi_cq_open(da, &cq_attr, &cqa, NULL) == 0);
	REQUIRE(fi_cq_open(da, &cq_attr, &cqa2, NULL) == 0);
	REQUIRE(fi_cq_open(db, &cq_attr, &cqb, NULL) == 0);

	/* B: an endpoint with an AV of its own. */
	struct fi_av_attr plain = {.type = FI_AV_MAP};
	struct fid_av *avb;
	REQUIRE(fi_av_open(db, &plain, &avb, NULL) == 0);
	struct fid_ep *eb = ct_ep_open(db, list->next, &avb->fid, cqb);
	char bname[64];
	size_t blen = sizeof(bname);
	REQUIRE(fi_getname(&eb->fid, bname, &blen) == 0);

	char name[64];
	snprintf(name, sizeof(name), "ctest-%d", (int)getpid());
	struct fid_av *no = NULL;
	/* Read-only: named, and existing. */
	struct fi_av_attr ro = {.type = FI_AV_MAP, .flags = FI_READ};
	CHECK_EQ(fi_av_open(da, &ro, &no, NULL), -FI_EINVAL);
	ro.name = name;
	CHECK_EQ(fi_av_open(da, &ro, &no, NULL), -FI_EINVAL);
	struct fi_av_attr bad = {.type = FI_AV_MAP, .name = "a/b"};
	CHECK_EQ(fi_av_open(da, &bad, &no, NULL), -FI_EINVAL);

	/* A creates the AV and inserts B's address; its map says so. */
	struct fi_av_attr w = {.type = FI_AV_MAP, .name = name, .count = 8};
	struct fid_av *avw;
	REQUIRE(fi_av_open(da, &w, &avw, NULL) == 0);
	REQUIRE(w.map_addr != NULL);
	fi_addr_t to_b = FI_ADDR_NOTAVAIL;
	REQUIRE(fi_av_insert(avw, bname, 1, &to_b, 0, NULL) == 1);
	CHECK_EQ(((fi_addr_t *)w.map_addr)[0], to_b);

	/* Opened again read-only: the same table. */
	ro.map_addr = NULL;
	struct fid_av *avr;
	REQUIRE(fi_av_open(da, &ro, &avr, NULL) == 0);
	REQUIRE(ro.map_addr != NULL);
	fi_addr_t shared_b = ((fi_addr_t *)ro.map_addr)[0];
	CHECK_EQ(shared_b, to_b);
	char got[64];
	size_t glen = sizeof(got);
	CHECK_EQ(fi_av_lookup(avr, shared_b, got, &glen), 0);
	CHECK(glen == blen && memcmp(got, bname, blen) == 0);
	/* It takes no inserts or removals. */
	fi_addr_t x = 0;
	CHECK_EQ(fi_av_insert(avr, bname, 1, &x, 0, NULL), -FI_EINVAL);
	CHECK_EQ(fi_av_remove(avr, &shared_b, 1, 0), -FI_EINVAL);

	/* Endpoints of A on either opener reach B with the one fi_addr_t. */
	struct fid_ep *ea = ct_ep_open(da, list, &avw->fid, cqa);
	struct fid_ep *ea2 = ct_ep_open(da, list, &avr->fid, cqa2);
	char *out = ct_pages(1 << 16), *in = ct_pages(1 << 16);
	exchange(ea, cqa, to_b, eb, cqb, out, in, 100, 1);
	exchange(ea2, cqa2, shared_b, eb, cqb, out + 4096, in + 4096, 200, 2);

	/* What the writer inserts later the reader sees; what it removes is gone for both. */
	fi_addr_t again = 0;
	REQUIRE(fi_av_insert(avw, bname, 1, &again, 0, NULL) == 1);
	CHECK_EQ(((fi_addr_t *)ro.map_addr)[1], again);
	glen = sizeof(got);
	CHECK_EQ(fi_av_lookup(avr, again, got, &glen), 0);
	CHECK_EQ(fi_av_remove(avw, &again, 1, 0), 0);
	glen = sizeof(got);
	CHECK_EQ(fi_av_lookup(avr, again, got, &glen), -FI_EINVAL);
	CHECK_EQ(((fi_addr_t *)ro.map_addr)[1], FI_ADDR_NOTAVAIL);

	/* The creator's AV closes (once its endpoint is gone): the name goes, the reader
	 * goes on. */
	CHECK_EQ(fi_close(&ea->fid), 0);
	CHECK_EQ(fi_close(&avw->fid), 0);
	ro.map_addr = NULL;
	CHECK_EQ(fi_av_open(da, &ro, &no, NULL), -FI_EINVAL);
	exchange(ea2, cqa2, shared_b, eb, cqb, out + 8192, in + 8192, 300, 3);

	CHECK_EQ(fi_close(&ea2->fid), 0);
	CHECK_EQ(fi_close(&avr->fid), 0);
	CHECK_EQ(fi_close(&eb->fid), 0);
	CHECK_EQ(fi_close(&avb->fid), 0);
	CHECK_EQ(fi_close(&cqa->fid), 0);
	CHECK_EQ(fi_close(&cqa2->fid), 0);
	CHECK_EQ(fi_close(&cqb->fid), 0);
	CHECK_EQ(fi_close(&da->fid), 0);
	CHECK_EQ(fi_close(&db->fid), 0);
	CHECK_EQ(fi_close(&fab->fid), 0);
	fi_freeinfo(list);
	return ct_summary_exit();
}
