/* Scaffold: replaced by the real parsers (every input deferred until then). */
#include "parse.h"
int sw_parse_s5_greeting(const uint8_t *buf, size_t len, sw_s5_greeting *out, uint8_t *reply, size_t *reply_len) { (void)buf; (void)len; (void)out; (void)reply; *reply_len = 0; return SW_PARSE_DEFER; }
int sw_parse_s5_userpass(const uint8_t *buf, size_t len, sw_s5_userpass *out, uint8_t *reply, size_t *reply_len) { (void)buf; (void)len; (void)out; (void)reply; *reply_len = 0; return SW_PARSE_DEFER; }
int sw_parse_s5_request(const uint8_t *buf, size_t len, sw_s5_request *out, uint8_t *reply, size_t *reply_len) { (void)buf; (void)len; (void)out; (void)reply; *reply_len = 0; return SW_PARSE_DEFER; }
int sw_parse_http_connect(const uint8_t *buf, size_t len, sw_http_connect *out) { (void)buf; (void)len; (void)out; return SW_PARSE_DEFER; }
int sw_sniff(const uint8_t *buf, size_t len, sw_sniffed *out) { (void)buf; (void)len; (void)out; return SW_PARSE_ERROR; }
