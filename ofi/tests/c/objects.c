/* objects.c: fi_getinfo with hints, fabric, domain, address vectors, fi_getname,
 * completion queues of every format, memory regions, endpoint binding and enabling, and
 * closing: each with its bad inputs and the errno the man pages (or the provider's README,
 * where the man page leaves it open) give.
 */
#include "ctest.h"

static const uint64_t ALL_CAPS = FI_MSG | FI_TAGGED | FI_RMA | FI_ATOMIC | FI_DIRECTED_RECV;

static int count_infos(struct fi_info *i)
{
	int n = 0;
	for (; i; i = i->next)
		n++;
	return n;
}

static void getinfo(void)
{
	struct fi_info *h, *list = NULL;

	/* No hints: the provider's offers (FI_PROVIDER=ringbell keeps only those), per NIC
	 * its RDM one, then its datagram and connected ones. */
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, NULL, &list), 0);
	CHECK_EQ(count_infos(list), 6);
	static const int types[3] = {FI_EP_RDM, FI_EP_DGRAM, FI_EP_MSG};
	int k = 0;
	for (struct fi_info *i = list; i; i = i->next, k++) {
		CHECK(strcmp(i->fabric_attr->prov_name, "ringbell") == 0);
		CHECK_EQ(i->ep_attr->type, types[k % 3]);
		CHECK(i->domain_attr->name != NULL);
		if (i->domain_attr->name)
			CHECK(strcmp(i->domain_attr->name, k < 3 ? "rb0" : "rb1") == 0);
	}
	fi_freeinfo(list);

	/* Every capability the provider implements, with FI_MR_LOCAL. */
	h = ct_hints(ALL_CAPS, 1);
	list = NULL;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), 0);
	if (list) {
		CHECK_EQ(list->caps & ALL_CAPS, ALL_CAPS);
		CHECK(list->domain_attr->mr_mode & FI_MR_LOCAL);
		CHECK_EQ(list->domain_attr->mr_mode & (FI_MR_VIRT_ADDR | FI_MR_PROV_KEY),
			 FI_MR_VIRT_ADDR | FI_MR_PROV_KEY);
		CHECK(list->tx_attr->inject_size > 0);
		CHECK(list->domain_attr->cq_data_size >= 4);
		CHECK(list->ep_attr->max_msg_size >= (1 << 20));
		CHECK_EQ(list->addr_format, list->next ? list->next->addr_format : 0);
	}
	fi_freeinfo(list);
	fi_freeinfo(h);

	/* FI_MR_LOCAL off (as Open MPI asks): the offer needs no local registration. */
	h = ct_hints(FI_MSG | FI_TAGGED, 0);
	list = NULL;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), 0);
	if (list)
		CHECK_EQ(list->domain_attr->mr_mode & FI_MR_LOCAL, 0);
	fi_freeinfo(list);
	fi_freeinfo(h);

	/* Caps trimmed to those asked (plus secondary ones): FI_TAGGED alone. */
	h = ct_hints(FI_TAGGED, 1);
	list = NULL;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), 0);
	if (list)
		CHECK_EQ(list->caps & (FI_MSG | FI_RMA | FI_ATOMIC), 0);
	fi_freeinfo(list);
	fi_freeinfo(h);

	/* One domain by name. */
	h = ct_hints(FI_MSG, 1);
	h->domain_attr->name = strdup("rb1");
	list = NULL;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), 0);
	CHECK_EQ(count_infos(list), 1);
	if (list)
		CHECK(strcmp(list->domain_attr->name, "rb1") == 0);
	fi_freeinfo(list);
	fi_freeinfo(h);

	/* What the provider does not offer: -FI_ENODATA (fi_getinfo(3)); here tagged
	 * datagrams. */
	h = ct_hints(FI_MSG | FI_TAGGED, 1);
	h->ep_attr->type = FI_EP_DGRAM;
	list = NULL;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	CHECK(list == NULL);
	h->caps = FI_MSG;
	/* (Datagram and connected endpoints: dgram.c, msgep.c.) */
	/* Scalable endpoints of more contexts than max_ep_tx_ctx/max_ep_rx_ctx (16; fewer
	 * are offered: scalable.c); shared contexts are offered (shared_ctx.c). */
	h->ep_attr->type = FI_EP_RDM;
	h->ep_attr->tx_ctx_cnt = 17;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->ep_attr->tx_ctx_cnt = 0;
	h->ep_attr->rx_ctx_cnt = 17;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->ep_attr->rx_ctx_cnt = 1;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), 0);
	fi_freeinfo(list);
	list = NULL;
	h->ep_attr->rx_ctx_cnt = 0;
	h->ep_attr->type = FI_EP_RDM;
	h->caps = FI_MSG | FI_MULTICAST;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->caps = FI_MSG;
	free(h->domain_attr->name);
	h->domain_attr->name = strdup("rb7");
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	free(h->domain_attr->name);
	h->domain_attr->name = NULL;
	h->domain_attr->cq_data_size = 64;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->domain_attr->cq_data_size = 0;
	h->addr_format = FI_SOCKADDR_IN6;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->addr_format = FI_FORMAT_UNSPEC;
	h->tx_attr->inject_size = 1 << 20;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->tx_attr->inject_size = 0;
	/* The memory-registration modes of libfabric 1.4 and before. */
	h->domain_attr->mr_mode = FI_MR_BASIC;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->domain_attr->mr_mode = FI_MR_SCALABLE;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->domain_attr->mr_mode = FI_MR_LOCAL;
	/* A version libfabric 1.17 does not know. */
	CHECK_EQ(fi_getinfo(FI_VERSION(2, 0), NULL, NULL, 0, h, &list), -FI_ENOSYS);
	CHECK(list == NULL);
	fi_freeinfo(h);
}

/* Remote access without the mode bits it needs: an application that sets neither
 * FI_MR_PROV_KEY nor FI_MR_VIRT_ADDR picks its own keys and addresses by offset (fi_mr(3));
 * the provider must then refuse the offer or honour both. */
static void mr_mode_without_remote_bits(void)
{
	struct fi_info *h = ct_hints(FI_RMA, 1), *list = NULL;
	/* RMA asked for: refused. */
	h->domain_attr->mr_mode = FI_MR_LOCAL;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->domain_attr->mr_mode = FI_MR_PROV_KEY;
	h->caps = FI_ATOMIC;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	/* Nothing asked for: offered without remote memory. */
	h->caps = 0;
	h->domain_attr->mr_mode = 0;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	CHECK((list->caps & (FI_RMA | FI_ATOMIC | FI_REMOTE_READ | FI_REMOTE_WRITE)) == 0);
	CHECK(list->caps & FI_TAGGED);
	fi_freeinfo(list);
	fi_freeinfo(h);
}

static void domains(struct fid_fabric *fab, struct fi_info *list)
{
	struct fid_domain *d = NULL;
	struct fi_info *bad;

	/* A domain on each NIC, opened, closed and opened again. */
	CHECK_EQ(fi_domain(fab, list, &d, NULL), 0);
	if (d)
		CHECK_EQ(fi_close(&d->fid), 0);
	d = NULL;
	CHECK_EQ(fi_domain(fab, list->next, &d, (void *)0x5eed), 0);
	if (d) {
		CHECK(d->fid.context == (void *)0x5eed);
		CHECK_EQ(d->fid.fclass, FI_CLASS_DOMAIN);
		CHECK_EQ(fi_close(&d->fid), 0);
	}

	/* No info, a domain name that is not the provider's, a NIC that is not there. */
	d = NULL;
	CHECK_EQ(fi_domain(fab, NULL, &d, NULL), -FI_EINVAL);
	bad = fi_dupinfo(list);
	free(bad->domain_attr->name);
	bad->domain_attr->name = strdup("eth0");
	CHECK_EQ(fi_domain(fab, bad, &d, NULL), -FI_ENODATA);
	free(bad->domain_attr->name);
	bad->domain_attr->name = strdup("rb9");
	CHECK_EQ(fi_domain(fab, bad, &d, NULL), -FI_ENODEV);
	CHECK(d == NULL);
	fi_freeinfo(bad);
}

static void cqs(struct fid_domain *dom)
{
	static const enum fi_cq_format formats[] = { FI_CQ_FORMAT_UNSPEC, FI_CQ_FORMAT_CONTEXT,
						     FI_CQ_FORMAT_MSG, FI_CQ_FORMAT_DATA,
						     FI_CQ_FORMAT_TAGGED };
	struct fi_cq_attr attr;
	struct fid_cq *cq;
	struct fi_cq_tagged_entry e;
	struct fi_cq_err_entry err;
	char sbuf[128];

	for (size_t i = 0; i < sizeof(formats) / sizeof(formats[0]); i++) {
		memset(&attr, 0, sizeof(attr));
		attr.format = formats[i];
		attr.size = 16;
		cq = NULL;
		CHECK_EQ(fi_cq_open(dom, &attr, &cq, (void *)0xc0), 0);
		if (!cq)
			continue;
		CHECK_EQ(cq->fid.fclass, FI_CLASS_CQ);
		CHECK(cq->fid.context == (void *)0xc0);
		CHECK_EQ(fi_cq_read(cq, &e, 1), -FI_EAGAIN);
		CHECK_EQ(fi_cq_readfrom(cq, &e, 1, NULL), -FI_EAGAIN);
		CHECK_EQ(fi_cq_readerr(cq, &err, 0), -FI_EAGAIN);
		CHECK_EQ(fi_cq_read(cq, NULL, 1), -FI_EINVAL);
		CHECK_EQ(fi_cq_readerr(cq, NULL, 0), -FI_EINVAL);
		CHECK(fi_cq_strerror(cq, 0, NULL, sbuf, sizeof(sbuf)) != NULL);
		CHECK_EQ(fi_close(&cq->fid), 0);
	}

	/* A format that does not exist, no attributes, no output. */
	memset(&attr, 0, sizeof(attr));
	attr.format = (enum fi_cq_format)99;
	cq = NULL;
	CHECK_EQ(fi_cq_open(dom, &attr, &cq, NULL), -FI_EINVAL);
	CHECK_EQ(fi_cq_open(dom, NULL, &cq, NULL), -FI_EINVAL);
	attr.format = FI_CQ_FORMAT_CONTEXT;
	CHECK_EQ(fi_cq_open(dom, &attr, NULL, NULL), -FI_EINVAL);
	CHECK(cq == NULL);

	/* Wait objects: the provider waits by polling (FI_WAIT_UNSPEC, FI_WAIT_YIELD), on a
	 * file descriptor (FI_WAIT_FD), a mutex and condition (FI_WAIT_MUTEX_COND) or in a
	 * wait set (FI_WAIT_SET, which must name one: fdwait.c), and has no pollfd list to
	 * give out: -FI_ENOSYS for that, -FI_EINVAL for no wait object at all. */
	attr.wait_obj = FI_WAIT_MUTEX_COND;
	REQUIRE(fi_cq_open(dom, &attr, &cq, NULL) == 0);
	CHECK_EQ(fi_close(&cq->fid), 0);
	cq = NULL;
	attr.wait_obj = FI_WAIT_SET;
	CHECK_EQ(fi_cq_open(dom, &attr, &cq, NULL), -FI_EINVAL);
	attr.wait_obj = FI_WAIT_POLLFD;
	CHECK_EQ(fi_cq_open(dom, &attr, &cq, NULL), -FI_ENOSYS);
	attr.wait_obj = (enum fi_wait_obj)77;
	CHECK_EQ(fi_cq_open(dom, &attr, &cq, NULL), -FI_EINVAL);
	for (int w = 0; w < 2; w++) {
		attr.wait_obj = w ? FI_WAIT_YIELD : FI_WAIT_UNSPEC;
		attr.format = FI_CQ_FORMAT_TAGGED;
		cq = NULL;
		CHECK_EQ(fi_cq_open(dom, &attr, &cq, NULL), 0);
		if (!cq)
			continue;
		/* An empty CQ: fi_cq_sread waits out its timeout and says -FI_EAGAIN. */
		double t0 = ct_now();
		CHECK_EQ(fi_cq_sread(cq, &e, 1, NULL, 50), -FI_EAGAIN);
		CHECK(ct_now() - t0 >= 0.045);
		fi_addr_t src;
		CHECK_EQ(fi_cq_sreadfrom(cq, &e, 1, &src, NULL, 0), -FI_EAGAIN);
		CHECK_EQ(fi_close(&cq->fid), 0);
	}
}

static void avs(struct fid_domain *dom, const char *name_a, const char *name_b, size_t len)
{
	static const enum fi_av_type types[] = { FI_AV_TABLE, FI_AV_MAP, FI_AV_UNSPEC };
	struct fi_av_attr attr;
	struct fid_av *av;
	char both[128], out[64], str[128];
	size_t n;

	memcpy(both, name_a, len);
	memcpy(both + len, name_b, len);
	for (size_t t = 0; t < 3; t++) {
		memset(&attr, 0, sizeof(attr));
		attr.type = types[t];
		av = NULL;
		CHECK_EQ(fi_av_open(dom, &attr, &av, (void *)0xa7), 0);
		if (!av)
			continue;
		CHECK_EQ(av->fid.fclass, FI_CLASS_AV);
		fi_addr_t fa[2] = { 7, 7 };
		CHECK_EQ(fi_av_insert(av, both, 2, fa, 0, NULL), 2);
		CHECK(fa[0] != FI_ADDR_NOTAVAIL && fa[1] != FI_ADDR_NOTAVAIL && fa[0] != fa[1]);
		if (types[t] == FI_AV_TABLE) {
			/* FI_AV_TABLE: indices in insertion order from 0 (fi_av(3)). */
			CHECK_EQ(fa[0], 0);
			CHECK_EQ(fa[1], 1);
		}
		/* Lookup: the address back, its length; truncated into a short buffer. */
		n = sizeof(out);
		CHECK_EQ(fi_av_lookup(av, fa[1], out, &n), 0);
		CHECK_EQ(n, len);
		CHECK(memcmp(out, name_b, len) == 0);
		memset(out, 0, sizeof(out));
		n = 4;
		CHECK_EQ(fi_av_lookup(av, fa[0], out, &n), 0);
		CHECK_EQ(n, len);
		CHECK(memcmp(out, name_a, 4) == 0 && out[4] == 0);
		/* Out of range, no length. */
		n = sizeof(out);
		CHECK_EQ(fi_av_lookup(av, 1000, out, &n), -FI_EINVAL);
		CHECK_EQ(fi_av_lookup(av, FI_ADDR_NOTAVAIL, out, &n), -FI_EINVAL);
		CHECK_EQ(fi_av_lookup(av, fa[0], out, NULL), -FI_EINVAL);
		/* Straddr: a printable string, the needed length; truncated but terminated. */
		n = sizeof(str);
		CHECK(fi_av_straddr(av, name_a, str, &n) == str);
		CHECK(strlen(str) > 0 && n == strlen(str) + 1);
		size_t full = n;
		char small[5];
		n = sizeof(small);
		CHECK(fi_av_straddr(av, name_a, small, &n) == small);
		CHECK_EQ(n, full);
		CHECK_EQ(strlen(small), 4);
		CHECK(strncmp(small, str, 4) == 0);
		/* Remove one: its lookup fails, the other stays. */
		CHECK_EQ(fi_av_remove(av, &fa[0], 1, 0), 0);
		n = sizeof(out);
		CHECK_EQ(fi_av_lookup(av, fa[0], out, &n), -FI_EINVAL);
		n = sizeof(out);
		CHECK_EQ(fi_av_lookup(av, fa[1], out, &n), 0);
		fi_addr_t far = 5000;
		CHECK_EQ(fi_av_remove(av, &far, 1, 0), -FI_EINVAL);
		CHECK_EQ(fi_av_remove(av, NULL, 1, 0), -FI_EINVAL);
		/* An address that is not one of the provider's: not inserted, FI_ADDR_NOTAVAIL
		 * in its slot (fi_av(3)); the good one beside it is. */
		char mixed[128];
		memset(mixed, 0xee, len);
		memcpy(mixed + len, name_a, len);
		fa[0] = fa[1] = 7;
		CHECK_EQ(fi_av_insert(av, mixed, 2, fa, 0, NULL), 1);
		CHECK(fa[0] == FI_ADDR_NOTAVAIL);
		CHECK(fa[1] != FI_ADDR_NOTAVAIL);
		CHECK_EQ(fi_av_insert(av, NULL, 1, fa, 0, NULL), -FI_EINVAL);
		CHECK_EQ(fi_av_insert(av, both, 0, fa, 0, NULL), 0);
		CHECK_EQ(fi_close(&av->fid), 0);
	}
	memset(&attr, 0, sizeof(attr));
	attr.type = (enum fi_av_type)9;
	av = NULL;
	CHECK_EQ(fi_av_open(dom, &attr, &av, NULL), -FI_EINVAL);
	attr.type = FI_AV_TABLE;
	CHECK_EQ(fi_av_open(dom, &attr, NULL, NULL), -FI_EINVAL);
	CHECK(av == NULL);
}

static void mrs(struct fid_domain *dom)
{
	char *buf = ct_pages(3 * 4096);
	struct fid_mr *mr = NULL, *mr2 = NULL;
	struct iovec iov[2] = { { buf, 4096 }, { buf + 8192, 4096 } };
	struct fi_mr_attr attr = { 0 };

	CHECK_EQ(fi_mr_reg(dom, buf, 4096, FI_SEND | FI_RECV | FI_REMOTE_WRITE, 0, 0, 0, &mr,
			   (void *)0x3e),
		 0);
	if (mr) {
		CHECK_EQ(mr->fid.fclass, FI_CLASS_MR);
		CHECK(mr->fid.context == (void *)0x3e);
		CHECK(fi_mr_key(mr) != FI_KEY_NOTAVAIL);
		CHECK(fi_mr_desc(mr) != NULL);
	}
	/* A second registration of the same range: its own key. */
	CHECK_EQ(fi_mr_reg(dom, buf, 4096, FI_READ, 0, 0, 0, &mr2, NULL), 0);
	if (mr && mr2)
		CHECK(fi_mr_key(mr) != fi_mr_key(mr2));
	if (mr2)
		CHECK_EQ(fi_close(&mr2->fid), 0);
	if (mr)
		CHECK_EQ(fi_close(&mr->fid), 0);

	/* regv and regattr of one range; several ranges are refused (README: one range). */
	mr = NULL;
	CHECK_EQ(fi_mr_regv(dom, iov, 1, FI_RECV, 0, 0, 0, &mr, NULL), 0);
	if (mr)
		CHECK_EQ(fi_close(&mr->fid), 0);
	CHECK_EQ(fi_mr_regv(dom, iov, 2, FI_RECV, 0, 0, 0, &mr, NULL), -FI_EINVAL);
	attr.mr_iov = iov;
	attr.iov_count = 1;
	attr.access = FI_REMOTE_READ;
	attr.context = (void *)0x44;
	mr = NULL;
	CHECK_EQ(fi_mr_regattr(dom, &attr, 0, &mr), 0);
	if (mr) {
		CHECK(mr->fid.context == (void *)0x44);
		CHECK_EQ(fi_close(&mr->fid), 0);
	}
	attr.iov_count = 2;
	CHECK_EQ(fi_mr_regattr(dom, &attr, 0, &mr), -FI_EINVAL);
	CHECK_EQ(fi_mr_regattr(dom, NULL, 0, &mr), -FI_EINVAL);

	/* Bad ranges: NULL, empty, not mapped; no output pointer. */
	CHECK_EQ(fi_mr_reg(dom, NULL, 4096, FI_RECV, 0, 0, 0, &mr, NULL), -FI_EINVAL);
	CHECK_EQ(fi_mr_reg(dom, buf, 0, FI_RECV, 0, 0, 0, &mr, NULL), -FI_EINVAL);
	CHECK_EQ(fi_mr_reg(dom, buf, 4096, FI_RECV, 0, 0, 0, NULL, NULL), -FI_EINVAL);
	char *gone = ct_pages(4096);
	munmap(gone, 4096);
	CHECK_EQ(fi_mr_reg(dom, gone, 4096, FI_RECV, 0, 0, 0, &mr, NULL), -FI_EINVAL);
}

static void endpoints(struct fid_fabric *fab, struct fi_info *info, struct fid_domain *dom)
{
	struct fi_cq_attr cq_attr = { .format = FI_CQ_FORMAT_TAGGED, .size = 64 };
	struct fi_av_attr av_attr = { .type = FI_AV_TABLE };
	struct fid_cq *cq = NULL;
	struct fid_av *av = NULL;
	struct fid_ep *ep = NULL;
	char name[64], *buf = ct_pages(4096);
	size_t len;

	REQUIRE(fi_cq_open(dom, &cq_attr, &cq, NULL) == 0);
	REQUIRE(fi_av_open(dom, &av_attr, &av, NULL) == 0);
	CHECK_EQ(fi_endpoint(dom, info, NULL, NULL), -FI_EINVAL);
	REQUIRE(fi_endpoint(dom, info, &ep, (void *)0xe9) == 0);
	CHECK_EQ(ep->fid.fclass, FI_CLASS_EP);
	CHECK(ep->fid.context == (void *)0xe9);

	/* fi_getname: the address; too small a buffer is -FI_ETOOSMALL with the length
	 * needed (fi_cm(3)). */
	len = 0;
	CHECK_EQ(fi_getname(&ep->fid, NULL, &len), -FI_ETOOSMALL);
	CHECK_EQ(len, info->src_addrlen ? info->src_addrlen : 16);
	size_t need = len;
	len = need - 1;
	CHECK_EQ(fi_getname(&ep->fid, name, &len), -FI_ETOOSMALL);
	CHECK_EQ(len, need);
	len = sizeof(name);
	CHECK_EQ(fi_getname(&ep->fid, name, &len), 0);
	CHECK_EQ(len, need);
	CHECK_EQ(fi_getname(&ep->fid, name, NULL), -FI_EINVAL);
	char before[64];
	memcpy(before, name, need);

	/* An event queue (RDM endpoints report nothing on it): empty, bindable. */
	struct fi_eq_attr eq_attr = { .size = 16, .wait_obj = FI_WAIT_NONE };
	struct fid_eq *eq = NULL;
	uint32_t event;
	struct fi_eq_entry eqe;
	struct fi_eq_err_entry eqerr = { 0 };
	CHECK_EQ(fi_eq_open(fab, &eq_attr, &eq, (void *)0xe0), 0);
	if (eq) {
		CHECK_EQ(eq->fid.fclass, FI_CLASS_EQ);
		CHECK_EQ(fi_eq_read(eq, &event, &eqe, sizeof(eqe), 0), -FI_EAGAIN);
		CHECK_EQ(fi_eq_readerr(eq, &eqerr, 0), -FI_EAGAIN);
		CHECK_EQ(fi_eq_sread(eq, &event, &eqe, sizeof(eqe), 10, 0), -FI_EAGAIN);
		CHECK_EQ(fi_ep_bind(ep, &eq->fid, 0), 0);
	}
	CHECK_EQ(fi_eq_open(fab, &eq_attr, NULL, NULL), -FI_EINVAL);

	/* Nothing moves before fi_enable (fi_endpoint(3): -FI_EOPBADSTATE). */
	CHECK_EQ(fi_send(ep, buf, 8, NULL, 0, NULL), -FI_EOPBADSTATE);
	CHECK_EQ(fi_recv(ep, buf, 8, NULL, FI_ADDR_UNSPEC, NULL), -FI_EOPBADSTATE);
	CHECK_EQ(fi_trecv(ep, buf, 8, NULL, FI_ADDR_UNSPEC, 1, 0, NULL), -FI_EOPBADSTATE);

	/* Enabling needs an AV and both CQs (fi_endpoint(3): -FI_ENOAV / -FI_ENOCQ); the
	 * provider says -FI_ENOCQ for any of them missing. */
	int r = fi_enable(ep);
	CHECK(r == -FI_ENOCQ || r == -FI_ENOAV);
	CHECK_EQ(fi_ep_bind(ep, &av->fid, 0), 0);
	CHECK_EQ(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT), 0);
	CHECK_EQ(fi_enable(ep), -FI_ENOCQ);
	/* Binding what cannot be bound: the domain, the endpoint itself. */
	CHECK_EQ(fi_ep_bind(ep, &dom->fid, 0), -FI_EINVAL);
	CHECK_EQ(fi_ep_bind(ep, &fab->fid, 0), -FI_EINVAL);
	CHECK_EQ(fi_ep_bind(ep, &ep->fid, 0), -FI_EINVAL);
	CHECK_EQ(fi_ep_bind(ep, &cq->fid, FI_RECV | FI_SELECTIVE_COMPLETION), 0);
	CHECK_EQ(fi_enable(ep), 0);
	CHECK_EQ(fi_enable(ep), 0);
	/* The address does not change when the endpoint is enabled. */
	len = sizeof(name);
	CHECK_EQ(fi_getname(&ep->fid, name, &len), 0);
	CHECK(memcmp(before, name, need) == 0);
	/* Bindings are set before fi_enable. */
	CHECK_EQ(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT), -FI_EOPBADSTATE);
	/* Options the provider does not have (FI_OPT_MIN_MULTI_RECV it has: multi_recv.c). */
	size_t optlen = sizeof(size_t), v = 0;
	CHECK_EQ(fi_getopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_CM_DATA_SIZE, &v, &optlen),
		 -FI_ENOPROTOOPT);
	CHECK_EQ(fi_setopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_BUFFERED_LIMIT, &v, optlen),
		 -FI_ENOPROTOOPT);
	/* A send to an address not in the AV (the AV is empty): -FI_EINVAL. */
	CHECK_EQ(fi_send(ep, buf, 8, NULL, 0, NULL), -FI_EINVAL);
	CHECK_EQ(fi_tsend(ep, buf, 8, NULL, 3, 1, NULL), -FI_EINVAL);

	CHECK_EQ(fi_close(&ep->fid), 0);
	if (eq)
		CHECK_EQ(fi_close(&eq->fid), 0);
	CHECK_EQ(fi_close(&av->fid), 0);
	CHECK_EQ(fi_close(&cq->fid), 0);
}

/* ---- closing: each scenario in a child process, as a closed object is freed ---- */

static struct fi_info *child_info;
static struct fid_fabric *child_fab;
static struct fid_domain *child_dom;
static struct fid_cq *child_cq;
static struct fid_av *child_av;
static struct fid_ep *child_ep;

/* In a child: fabric, domain on rb0, CQ, AV and an enabled endpoint. */
static int child_open(void)
{
	struct fi_info *h = ct_hints(FI_MSG | FI_TAGGED, 1);
	struct fi_cq_attr cq_attr = { .format = FI_CQ_FORMAT_TAGGED, .size = 64 };
	struct fi_av_attr av_attr = { .type = FI_AV_TABLE };
	if (fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &child_info) || fi_fabric(child_info->fabric_attr, &child_fab, NULL) ||
	    fi_domain(child_fab, child_info, &child_dom, NULL) ||
	    fi_cq_open(child_dom, &cq_attr, &child_cq, NULL) ||
	    fi_av_open(child_dom, &av_attr, &child_av, NULL) ||
	    fi_endpoint(child_dom, child_info, &child_ep, NULL) ||
	    fi_ep_bind(child_ep, &child_av->fid, 0) ||
	    fi_ep_bind(child_ep, &child_cq->fid, FI_TRANSMIT | FI_RECV) || fi_enable(child_ep))
		return 0;
	fi_freeinfo(h);
	return 1;
}

/* Child exit codes: 0 as libfabric asks, 1 close returned 0 where -FI_EBUSY is due, 3 the
 * set-up failed, 4 another value. */
static int busy_code(int r)
{
	fprintf(stderr, "  (fi_close gave %d)\n", r);
	return r == -FI_EBUSY ? 0 : r == 0 ? 1 : 4;
}

static int close_domain_with_endpoint(void)
{
	if (!child_open())
		return 3;
	return busy_code(fi_close(&child_dom->fid));
}

static int close_cq_bound_to_endpoint(void)
{
	if (!child_open())
		return 3;
	return busy_code(fi_close(&child_cq->fid));
}

static int close_av_bound_to_endpoint(void)
{
	if (!child_open())
		return 3;
	return busy_code(fi_close(&child_av->fid));
}

static int close_fabric_with_domain(void)
{
	if (!child_open())
		return 3;
	return busy_code(fi_close(&child_fab->fid));
}

/* Closing twice: the second close of each object is -FI_EINVAL (README: a closed fid is
 * refused), never a crash. Exit 0 when every second close says so. */
static int close_twice(void)
{
	struct fid_mr *mr = NULL;
	char *buf = ct_pages(4096);
	if (!child_open() || fi_mr_reg(child_dom, buf, 4096, FI_RECV, 0, 0, 0, &mr, NULL))
		return 3;
	struct fid *order[] = { &mr->fid, &child_ep->fid, &child_av->fid, &child_cq->fid,
				&child_dom->fid, &child_fab->fid };
	int bad = 0;
	for (size_t i = 0; i < sizeof(order) / sizeof(order[0]); i++) {
		int a = fi_close(order[i]);
		int b = fi_close(order[i]);
		if (a != 0 || b != -FI_EINVAL) {
			fprintf(stderr, "  close twice of object %zu: %d then %d\n", i, a, b);
			bad = 1;
		}
	}
	return bad ? 4 : 0;
}

/* The objects of a closed domain's endpoint stay safe to use and close: nothing crashes
 * after a close in the wrong order that the provider accepted. */
static int wrong_order_then_use(void)
{
	char *buf = ct_pages(4096);
	struct fi_cq_tagged_entry e;
	if (!child_open())
		return 3;
	fi_close(&child_cq->fid);
	fi_close(&child_av->fid);
	fi_close(&child_dom->fid);
	ssize_t s = fi_send(child_ep, buf, 8, NULL, 0, NULL);
	ssize_t r = fi_cq_read(child_cq, &e, 1);
	int c = fi_close(&child_ep->fid);
	fprintf(stderr, "  after closing CQ, AV, domain: fi_send %zd, fi_cq_read %zd, close ep %d\n",
		s, r, c);
	fi_close(&child_fab->fid);
	return 0;
}

static void closing(void)
{
	/* -FI_EBUSY while objects are open in the domain, or bound to an endpoint
	 * (fi_domain(3), fi_cq(3), fi_av(3)); a fabric with a domain open too. */
	CHECK_EQ(ct_in_child(close_domain_with_endpoint), 0);
	CHECK_EQ(ct_in_child(close_cq_bound_to_endpoint), 0);
	CHECK_EQ(ct_in_child(close_av_bound_to_endpoint), 0);
	CHECK_EQ(ct_in_child(close_fabric_with_domain), 0);
	CHECK_EQ(ct_in_child(close_twice), 0);
	CHECK_EQ(ct_in_child(wrong_order_then_use), 0);
}

/* What libfabric's fabtests found (fi_getinfo_test, fi_cq_test, fi_eq_test): the
 * FI_RX_CQ_DATA mode offered to an application that supports it and not to one that does
 * not; FI_LOCAL_COMM and FI_REMOTE_COMM in the info's and domain's caps, not the
 * endpoint's; fi_cq_signal unblocking fi_cq_sread; fi_eq_sread waiting out its timeout. */
static void fabtests_findings(struct fid_fabric *fab, struct fid_domain *dom)
{
	struct fi_info *h = ct_hints(FI_MSG | FI_RMA, 1), *list = NULL;
	h->mode = FI_CONTEXT | FI_RX_CQ_DATA;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	CHECK(list->mode & FI_RX_CQ_DATA);
	CHECK(list->caps & FI_LOCAL_COMM);
	CHECK((list->tx_attr->caps & (FI_LOCAL_COMM | FI_REMOTE_COMM)) == 0);
	CHECK((list->rx_attr->caps & (FI_LOCAL_COMM | FI_REMOTE_COMM)) == 0);
	fi_freeinfo(list);
	h->mode = FI_CONTEXT;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	CHECK((list->mode & FI_RX_CQ_DATA) == 0);
	/* Every offer has a source address: its NIC's (16 bytes). */
	CHECK(list->src_addr != NULL && list->src_addrlen == 16);
	fi_freeinfo(list);
	/* A node that names nothing; a NIC's own address as the source selects that NIC; a
	 * node and a service name a peer: the offer's destination. */
	CHECK_EQ(fi_getinfo(CT_VERSION, "g00n13s", NULL, 0, h, &list), -FI_ENODATA);
	REQUIRE(fi_getinfo(CT_VERSION, "10.0.0.2", NULL, FI_SOURCE, h, &list) == 0);
	CHECK(list->next == NULL && strcmp(list->domain_attr->name, "rb1") == 0);
	fi_freeinfo(list);
	REQUIRE(fi_getinfo(CT_VERSION, "10.0.0.1", "4660", 0, h, &list) == 0);
	CHECK(list->dest_addr != NULL && list->dest_addrlen == 16);
	fi_freeinfo(list);
	/* A domain capability the provider does not have (device memory, FI_HMEM). */
	h->domain_attr->caps = FI_HMEM;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list), -FI_ENODATA);
	h->domain_attr->caps = FI_LOCAL_COMM | FI_REMOTE_COMM;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	fi_freeinfo(list);
	fi_freeinfo(h);

	struct fi_cq_attr attr = { .format = FI_CQ_FORMAT_CONTEXT, .size = 16,
				   .wait_obj = FI_WAIT_UNSPEC };
	struct fid_cq *cq = NULL;
	struct fi_cq_entry e;
	REQUIRE(fi_cq_open(dom, &attr, &cq, NULL) == 0);
	CHECK_EQ(fi_cq_signal(cq), 0);
	double t0 = ct_now();
	CHECK_EQ(fi_cq_sread(cq, &e, 1, NULL, -1), -FI_EAGAIN); /* would wait for ever */
	CHECK(ct_now() - t0 < 5);
	t0 = ct_now();
	CHECK_EQ(fi_cq_sread(cq, &e, 1, NULL, 50), -FI_EAGAIN);
	CHECK(ct_now() - t0 >= 0.05);
	CHECK_EQ(fi_close(&cq->fid), 0);

	struct fi_eq_attr eattr = { .size = 8, .wait_obj = FI_WAIT_UNSPEC };
	struct fid_eq *eq = NULL;
	uint32_t ev;
	char buf[64];
	REQUIRE(fi_eq_open(fab, &eattr, &eq, NULL) == 0);
	t0 = ct_now();
	CHECK_EQ(fi_eq_sread(eq, &ev, buf, sizeof(buf), 50, 0), -FI_EAGAIN);
	CHECK(ct_now() - t0 >= 0.05);
	CHECK_EQ(fi_close(&eq->fid), 0);
}

int main(void)
{
	ct_name = "objects";
	struct fi_info *h, *list = NULL;
	struct fid_fabric *fab = NULL;
	struct fid_domain *dom = NULL;

	/* Children first: this process has opened nothing yet. */
	closing();

	getinfo();
	mr_mode_without_remote_bits();

	h = ct_hints(FI_MSG | FI_TAGGED | FI_RMA | FI_ATOMIC, 1);
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0 && list->next);
	fi_freeinfo(h);
	REQUIRE(fi_fabric(list->fabric_attr, &fab, (void *)0xfab) == 0);
	CHECK_EQ(fab->fid.fclass, FI_CLASS_FABRIC);
	CHECK(fab->fid.context == (void *)0xfab);
	domains(fab, list);
	REQUIRE(fi_domain(fab, list, &dom, NULL) == 0);
	cqs(dom);
	mrs(dom);
	fabtests_findings(fab, dom);
	endpoints(fab, list, dom);

	/* Two real addresses for the AV checks: endpoints of the two NICs. */
	{
		struct ct_pair p;
		struct ct_opts o = { .caps = FI_MSG, .mr_local = 1 };
		ct_pair_open(&p, &o);
		CHECK_EQ(p.a.namelen, p.b.namelen);
		CHECK(memcmp(p.a.name, p.b.name, p.a.namelen) != 0);
		avs(dom, p.a.name, p.b.name, p.a.namelen);
		ct_pair_close(&p);
	}

	CHECK_EQ(fi_close(&dom->fid), 0);
	CHECK_EQ(fi_close(&fab->fid), 0);
	fi_freeinfo(list);
	return ct_summary_exit();
}
