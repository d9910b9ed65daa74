from tpagent.proto import compile_proto

compile_proto()
