/* Raw packet QPs (IBV_QPT_RAW_PACKET), flow steering (ibv_create_flow(3)), multicast
 * attach, and RSS over receive WQs (ibv_create_wq(3), ibv_create_rwq_ind_table(3)):
 * frames sent whole from rb0 and steered on rb1 by Ethernet, IPv4, IPv6, TCP and UDP specs;
 * what is refused (errnos); a QP held by its rules (EBUSY), a table by its QP, a WQ by its
 * table; frames spread by the hash over two WQs. */
#include "common.h"

static const uint8_t MC[6] = {0x01, 0x00, 0x5e, 0x01, 0x02, 0x03};
static const uint8_t SRC[6] = {0x24, 0x8a, 0x07, 0xa5, 0x28, 0xc8};
/* rb1's MAC address (node 1 of the fabric). */
static const uint8_t RB1[6] = {0x02, 0, 0, 0, 0, 0x02};

static struct side a, b;

/* An Ethernet frame to `dst`: IPv4 UDP from `sip`:1234 to 2.2.2.2:`dport`, 32 bytes of
 * payload `seed`. Returns its length. */
static size_t udp4_frame(uint8_t *f, const uint8_t *dst, uint32_t sip, uint16_t dport,
			 unsigned seed)
{
	memset(f, 0, 128);
	memcpy(f, dst, 6);
	memcpy(f + 6, SRC, 6);
	f[12] = 0x08;
	f[14] = 0x45;
	f[16] = 0;
	f[17] = 20 + 8 + 32;
	f[22] = 64;
	f[23] = 17;
	uint32_t s = htonl(sip), d = htonl(0x02020202);
	memcpy(f + 26, &s, 4);
	memcpy(f + 30, &d, 4);
	uint16_t sp = htons(1234), dp = htons(dport), ul = htons(8 + 32);
	memcpy(f + 34, &sp, 2);
	memcpy(f + 36, &dp, 2);
	memcpy(f + 38, &ul, 2);
	fill(f + 42, 32, seed);
	return 42 + 32;
}

static struct ibv_qp *raw_qp(struct side *s, struct ibv_cq *cq)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = cq,
		.recv_cq = cq,
		.cap = {.max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_RAW_PACKET,
	};
	struct ibv_qp *qp = ibv_create_qp(s->pd, &ia);
	CHECK(qp != NULL);
	struct ibv_qp_attr at = {.qp_state = IBV_QPS_INIT, .port_num = 1};
	/* A raw packet QP takes the port alone to INIT (a P_Key index is refused). */
	CHECK_RET(ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX), EINVAL);
	CHECK_RET(ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_PORT), 0);
	at.qp_state = IBV_QPS_RTR;
	CHECK_RET(ibv_modify_qp(qp, &at, IBV_QP_STATE), 0);
	at.qp_state = IBV_QPS_RTS;
	CHECK_RET(ibv_modify_qp(qp, &at, IBV_QP_STATE), 0);
	return qp;
}

/* A rule with up to three specs, laid out as ibv_create_flow(3) reads it. */
struct rule {
	struct ibv_flow_attr attr;
	uint8_t specs[256];
};

static void add_spec(struct rule *r, const void *spec, size_t size)
{
	size_t at = 0;
	for (int i = 0; i < r->attr.num_of_specs; i++)
		at += ((const struct ibv_flow_spec_eth *)(r->specs + at))->size;
	memcpy(r->specs + at, spec, size);
	r->attr.num_of_specs++;
	r->attr.size += size;
}

static struct rule rule_new(void)
{
	struct rule r;
	memset(&r, 0, sizeof(r));
	r.attr.type = IBV_FLOW_ATTR_NORMAL;
	r.attr.size = sizeof(r.attr);
	r.attr.port = 1;
	return r;
}

static struct ibv_flow_spec_eth eth_spec(const uint8_t *dst)
{
	struct ibv_flow_spec_eth e = {.type = IBV_FLOW_SPEC_ETH, .size = sizeof(e)};
	memcpy(e.val.dst_mac, dst, 6);
	memset(e.mask.dst_mac, 0xff, 6);
	return e;
}

static void send_frame(struct ibv_qp *qp, struct ibv_cq *cq, uint8_t *f, size_t len,
		       uint32_t lkey, uint64_t id)
{
	struct ibv_sge sg = {.addr = (uintptr_t)f, .length = (uint32_t)len, .lkey = lkey};
	struct ibv_send_wr wr = {.wr_id = id, .sg_list = &sg, .num_sge = 1,
				 .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
	struct ibv_send_wr *bad;
	CHECK_RET(ibv_post_send(qp, &wr, &bad), 0);
	struct ibv_wc wc;
	EXPECT_WC(cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	CHECK_EQ(wc.wr_id, id);
}

int main(void)
{
	side_open(&a, "rb0", 1 << 16, 64);
	side_open(&b, "rb1", 1 << 16, 64);
	struct ibv_cq *idle = ibv_create_cq(b.ctx, 4, NULL, NULL, 0);
	CHECK(idle != NULL);
	struct ibv_qp *tx = raw_qp(&a, a.cq);
	struct ibv_qp *rx = raw_qp(&b, b.cq);
	uint8_t *f = a.buf;
	struct ibv_wc wc;

	/* ---- a unicast frame through Ethernet + IPv4 + UDP specs ---- */
	struct rule r = rule_new();
	struct ibv_flow_spec_eth e = eth_spec(RB1);
	add_spec(&r, &e, sizeof(e));
	struct ibv_flow_spec_ipv4 ip = {.type = IBV_FLOW_SPEC_IPV4, .size = sizeof(ip)};
	ip.val.dst_ip = htonl(0x02020202);
	ip.mask.dst_ip = 0xffffffff;
	add_spec(&r, &ip, sizeof(ip));
	struct ibv_flow_spec_tcp_udp udp = {.type = IBV_FLOW_SPEC_UDP, .size = sizeof(udp)};
	udp.val.dst_port = htons(5678);
	udp.mask.dst_port = 0xffff;
	add_spec(&r, &udp, sizeof(udp));
	struct ibv_flow *fl = ibv_create_flow(rx, &r.attr);
	CHECK(fl != NULL && fl->context == b.ctx);
	post_recv(rx, 7, b.buf, 1024, b.mr->lkey);
	size_t n = udp4_frame(f, RB1, 0x01010101, 5678, 1);
	send_frame(tx, a.cq, f, n, a.mr->lkey, 1);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 7);
	CHECK_EQ(wc.byte_len, n);
	CHECK_EQ(wc.qp_num, rx->qp_num);
	CHECK(memcmp(b.buf, f, n) == 0);
	/* Another port: no rule takes it. */
	n = udp4_frame(f, RB1, 0x01010101, 5679, 2);
	send_frame(tx, a.cq, f, n, a.mr->lkey, 2);
	EXPECT_NO_WC(b.cq, 200);

	/* ---- refusals ---- */
	CHECK_NULL_ERRNO(ibv_create_flow(rx, NULL), EINVAL);
	struct rule bad = rule_new();
	struct ibv_flow_spec_eth vl = eth_spec(RB1);
	vl.mask.vlan_tag = htons(0x0fff);
	add_spec(&bad, &vl, sizeof(vl));
	CHECK_NULL_ERRNO(ibv_create_flow(rx, &bad.attr), EOPNOTSUPP);
	bad = rule_new();
	bad.attr.type = IBV_FLOW_ATTR_SNIFFER;
	CHECK_NULL_ERRNO(ibv_create_flow(rx, &bad.attr), EOPNOTSUPP);
	bad = rule_new();
	bad.attr.flags = IBV_FLOW_ATTR_FLAGS_DONT_TRAP;
	CHECK_NULL_ERRNO(ibv_create_flow(rx, &bad.attr), EOPNOTSUPP);
	bad = rule_new();
	bad.attr.port = 2;
	CHECK_NULL_ERRNO(ibv_create_flow(rx, &bad.attr), EINVAL);
	bad = rule_new();
	struct ibv_flow_spec_eth inner = eth_spec(RB1);
	inner.type = IBV_FLOW_SPEC_ETH | IBV_FLOW_SPEC_INNER;
	add_spec(&bad, &inner, sizeof(inner));
	CHECK_NULL_ERRNO(ibv_create_flow(rx, &bad.attr), EOPNOTSUPP);
	/* An Ethernet spec for IPv6 and an IPv4 spec contradict each other. */
	bad = rule_new();
	struct ibv_flow_spec_eth v6 = eth_spec(RB1);
	v6.val.ether_type = htons(0x86dd);
	v6.mask.ether_type = 0xffff;
	add_spec(&bad, &v6, sizeof(v6));
	add_spec(&bad, &ip, sizeof(ip));
	CHECK_NULL_ERRNO(ibv_create_flow(rx, &bad.attr), EINVAL);
	/* A spec too short for its type. */
	bad = rule_new();
	struct ibv_flow_spec_eth shorty = eth_spec(RB1);
	shorty.size = 8;
	add_spec(&bad, &shorty, sizeof(shorty));
	CHECK_NULL_ERRNO(ibv_create_flow(rx, &bad.attr), EINVAL);
	/* Only raw packet QPs take rules. */
	struct qp_opts o = default_qp_opts();
	struct ibv_qp *rc = side_qp(&b, &o);
	CHECK_NULL_ERRNO(ibv_create_flow(rc, &r.attr), EINVAL);
	CHECK_RET(ibv_attach_mcast(rc, &(union ibv_gid){0}, 0), EOPNOTSUPP);
	CHECK_RET(ibv_destroy_qp(rc), 0);
	b.qp = NULL;
	/* A raw packet QP sends SEND only. */
	struct ibv_sge sg = {.addr = (uintptr_t)f, .length = 64, .lkey = a.mr->lkey};
	struct ibv_send_wr w = {.wr_id = 9, .sg_list = &sg, .num_sge = 1,
				.opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED};
	struct ibv_send_wr *badw;
	CHECK_RET(ibv_post_send(tx, &w, &badw), EINVAL);
	CHECK(badw == &w);

	/* ---- rules hold their QP ---- */
	CHECK_RET(ibv_destroy_qp(rx), EBUSY);
	CHECK_RET(ibv_destroy_flow(fl), 0);

	/* ---- multicast ---- */
	union ibv_gid g = {0};
	memcpy(&g.raw[10], MC, 6);
	CHECK_RET(ibv_attach_mcast(rx, &g, 0), 0);
	CHECK_RET(ibv_attach_mcast(rx, &g, 0), 0);
	union ibv_gid uni = {0};
	memcpy(&uni.raw[10], RB1, 6);
	CHECK_RET(ibv_attach_mcast(rx, &uni, 0), EINVAL);
	post_recv(rx, 8, b.buf, 1024, b.mr->lkey);
	n = udp4_frame(f, MC, 0x01010101, 9, 3);
	send_frame(tx, a.cq, f, n, a.mr->lkey, 3);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 8);
	CHECK(memcmp(b.buf, f, n) == 0);
	CHECK_RET(ibv_destroy_qp(rx), EBUSY);
	CHECK_RET(ibv_detach_mcast(rx, &g, 0), 0);
	CHECK_RET(ibv_detach_mcast(rx, &g, 0), EINVAL);
	send_frame(tx, a.cq, f, n, a.mr->lkey, 4);
	EXPECT_NO_WC(b.cq, 200);
	CHECK_RET(ibv_destroy_qp(rx), 0);

	/* ---- RSS over two receive WQs ---- */
	struct ibv_device_attr_ex dx;
	CHECK_RET(ibv_query_device_ex(b.ctx, NULL, &dx), 0);
	CHECK(dx.rss_caps.supported_qpts & (1 << IBV_QPT_RAW_PACKET));
	CHECK(dx.rss_caps.max_rwq_indirection_table_size >= 2);
	CHECK(dx.rss_caps.rx_hash_function & IBV_RX_HASH_FUNC_TOEPLITZ);
	struct ibv_cq *wcq[2];
	struct ibv_wq *wq[2];
	for (int i = 0; i < 2; i++) {
		wcq[i] = ibv_create_cq(b.ctx, 32, NULL, NULL, 0);
		CHECK(wcq[i] != NULL);
		struct ibv_wq_init_attr wa = {.wq_type = IBV_WQT_RQ, .max_wr = 16, .max_sge = 1,
					      .pd = b.pd, .cq = wcq[i]};
		wq[i] = ibv_create_wq(b.ctx, &wa);
		CHECK(wq[i] != NULL && wq[i]->state == IBV_WQS_RESET && wq[i]->cq == wcq[i]);
		CHECK(wa.max_wr >= 16);
		for (int j = 0; j < 8; j++) {
			struct ibv_sge s = {.addr = (uintptr_t)b.buf + (i * 8 + j) * 256,
					    .length = 256, .lkey = b.mr->lkey};
			struct ibv_recv_wr rw = {.wr_id = i * 100 + j, .sg_list = &s, .num_sge = 1};
			struct ibv_recv_wr *br;
			CHECK_RET(ibv_post_wq_recv(wq[i], &rw, &br), 0);
		}
		struct ibv_wq_attr ma = {.attr_mask = IBV_WQ_ATTR_STATE, .wq_state = IBV_WQS_RDY};
		CHECK_RET(ibv_modify_wq(wq[i], &ma), 0);
		CHECK_EQ(wq[i]->state, IBV_WQS_RDY);
	}
	struct ibv_rwq_ind_table_init_attr ta = {.log_ind_tbl_size = 1, .ind_tbl = wq};
	struct ibv_rwq_ind_table *tbl = ibv_create_rwq_ind_table(b.ctx, &ta);
	CHECK(tbl != NULL);
	uint8_t key[40];
	fill(key, sizeof(key), 77);
	struct ibv_qp_init_attr_ex qa = {
		.qp_type = IBV_QPT_RAW_PACKET,
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_RX_HASH |
			     IBV_QP_INIT_ATTR_IND_TABLE,
		.pd = b.pd,
		.rwq_ind_tbl = tbl,
		.rx_hash_conf = {.rx_hash_function = IBV_RX_HASH_FUNC_TOEPLITZ,
				 .rx_hash_key_len = sizeof(key),
				 .rx_hash_key = key,
				 .rx_hash_fields_mask = IBV_RX_HASH_SRC_IPV4 | IBV_RX_HASH_DST_IPV4},
	};
	struct ibv_qp *rss = ibv_create_qp_ex(b.ctx, &qa);
	CHECK(rss != NULL);
	r = rule_new();
	e = eth_spec(RB1);
	add_spec(&r, &e, sizeof(e));
	fl = ibv_create_flow(rss, &r.attr);
	CHECK(fl != NULL);
	int got[2] = {0, 0};
	for (unsigned k = 0; k < 16; k++) {
		n = udp4_frame(f, RB1, 0x0a000000 + k * 7919, 5678, 10 + k);
		send_frame(tx, a.cq, f, n, a.mr->lkey, 100 + k);
		int seen = 0;
		for (double end = now_s() + WAIT_S; !seen && now_s() < end;) {
			for (int i = 0; i < 2; i++) {
				int m = ibv_poll_cq(wcq[i], 1, &wc);
				if (m == 1) {
					CHECK_EQ(wc.status, IBV_WC_SUCCESS);
					CHECK_EQ(wc.byte_len, n);
					CHECK(memcmp(b.buf + (wc.wr_id / 100 * 8 + wc.wr_id % 100) * 256, f, n) == 0);
					got[i]++;
					seen = 1;
				}
			}
		}
		CHECK(seen);
	}
	CHECK(got[0] > 0 && got[1] > 0);
	CHECK_EQ(got[0] + got[1], 16);
	/* An RSS QP only receives, through its WQs. */
	CHECK_RET(ibv_post_send(rss, &w, &badw), EINVAL);
	/* Each holds the one before it. */
	CHECK_RET(ibv_destroy_rwq_ind_table(tbl), EBUSY);
	CHECK_RET(ibv_destroy_wq(wq[0]), EBUSY);
	CHECK_RET(ibv_destroy_flow(fl), 0);
	CHECK_RET(ibv_destroy_qp(rss), 0);
	CHECK_RET(ibv_destroy_rwq_ind_table(tbl), 0);
	for (int i = 0; i < 2; i++) {
		CHECK_RET(ibv_destroy_wq(wq[i]), 0);
		CHECK_RET(ibv_destroy_cq(wcq[i]), 0);
	}
	CHECK_RET(ibv_destroy_qp(tx), 0);
	CHECK_RET(ibv_destroy_cq(idle), 0);
	side_close(&a);
	side_close(&b);
	printf("raw: ok\n");
	return 0;
}
