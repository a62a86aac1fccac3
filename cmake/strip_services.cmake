# Copies the .proto IN to OUT without its `service` blocks. protoc-c's service stubs are not
# used (the runtime in common/ dispatches by method path) and would not compile for a method
# named like a C keyword (Coordinator.Register). Reflection still serves the full schema.
file(READ ${IN} text)
string(REGEX REPLACE "service [A-Za-z0-9_]+ {[^}]*}" "" text "${text}")
file(WRITE ${OUT} "${text}")
