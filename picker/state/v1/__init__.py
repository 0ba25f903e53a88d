"""Generated from proto/picker/state/v1/state.proto by tools/generate-proto.sh: do not edit."""
