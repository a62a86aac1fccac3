# Turns a binary file IN into a C source OUT defining `const unsigned char SYMBOL[]` and
# `const unsigned long SYMBOL_len`. Run with cmake -P.
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" hexlen)
math(EXPR nbytes "${hexlen} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n" body "${body}")
file(WRITE ${OUT} "/* Generated from ${IN}; do not edit. */\n"
  "const unsigned char ${SYMBOL}[] = {\n${body}0x00};\n"
  "const unsigned long ${SYMBOL}_len = ${nbytes};\n")
