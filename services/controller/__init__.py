"""The ratio controller: runs tandem.control's policy and applies it through an actuator."""
