package celeryproto

// unreadableHeaders refuses a delivery whose header table the transport
// could not read: without its headers a protocol 2 message has no task,
// id or arguments' context, and guessing them from the body would run
// something its producer did not send.
func unreadableHeaders(d *Delivery) error {
	if d.HeadersError == nil {
		return nil
	}
	return decodeErr(ErrBadHeader, d.HeadersError, "headers unreadable, dropped")
}
